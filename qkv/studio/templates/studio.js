"use strict";
// qkv studio's page: draws what the server sends; holds no attention arithmetic.
(function () {
  const words = JSON.parse(document.getElementById("qkv-words").textContent);
  const lang = document.body.dataset.lang;
  document.getElementById("app").textContent = words[lang].title;
})();
