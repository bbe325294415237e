"""qkv studio in a real browser: the app served by uvicorn on a free port, one headless Chromium
page driven through what a learner does — read the tutorial, type an ordinary long sentence on
the model the page opens on, read a weight by pointing at it, reload, meet the toy model's limit
and take the one click it offers, type a sentence, pick a focus, open a head and step to its
softmax, knock a head out and undo it, edit a sentence pair under a chosen token, switch to
Chinese — with the page's numbers checked against the analyses they come from
(``qkv.glass.trace_model``, ``qkv.analysis.explain``), and its safety checked: markup stays text,
the limit is a message, no stale index is ever sent, no console errors, no request leaves 127.0.0.1.

The steps share one page and run in order, as one test (each leaves the page where the next one
starts); the model loads once, in the server.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from ..browser import browser, skip_without_chromium  # noqa: F401  (browser: the shared fixture)
from ..helpers import bundled_model_dir

skip_without_chromium()
pytest.importorskip("fastapi", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")
uvicorn = pytest.importorskip("uvicorn", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")
bundled_model_dir(module_level=True)

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from qkv.locale import text as catalogue  # noqa: E402
from qkv.studio import LIMITS, Studio  # noqa: E402
from qkv.studio.server import create_app  # noqa: E402

TEXT = "Alice met Bob and she smiled."
LONG = ("The old librarian, who had worked in the small town for forty years, quietly closed the heavy wooden door "
        "and walked home through the rain.")  # an ordinary sentence of 25 words
TOKENS = ["[CLS]", "alice", "met", "bob", "and", "she", "smiled", ".", "[SEP]"]
SHE, ALICE = TOKENS.index("she"), TOKENS.index("alice")
WAIT_S = 120  # a ceiling, not a speed check: the longest any one wait may take (a cold model load on a busy machine included)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Studio]]:
    """The real app on 127.0.0.1 and a free port, in a background thread: (base URL, its Studio)."""
    studio = Studio(bundled=True)
    server = uvicorn.Server(uvicorn.Config(create_app(studio), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, name="qkv-studio-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            pytest.fail("the studio server did not start within 120 s")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", studio
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def page(browser: Any, served: tuple[str, Studio]) -> Any:  # noqa: F811  (the shared fixture, by name)
    """The studio's page, opened once for the whole module."""
    browser.get(served[0] + "/")
    return browser


def wait(driver: Any, condition: Any, what: str) -> Any:
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(condition, message=f"waiting for {what}")


def by_id(driver: Any, id_: str) -> Any:
    return driver.find_element(By.ID, id_)


def type_text(driver: Any, text: str) -> None:
    """Replace the text box's content the way a person does: select all, delete, type."""
    field = by_id(driver, "text")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    field.send_keys(text)


def analyses(driver: Any) -> int:
    """How many analyses the page has applied (it counts them on <body data-analyses>)."""
    return int(driver.execute_script("return +document.body.dataset.analyses || 0"))


def point_at(driver: Any, selector: str, row: int, col: int) -> str:
    """Move the mouse onto cell (row, col) of the map drawn on ``selector`` (a canvas) and return
    the tip it shows."""
    offset = driver.execute_script("""const c = document.querySelector(arguments[0]), g = c.qkvGeometry;
        c.scrollIntoView({ block: "center" });
        const r = c.getBoundingClientRect(), s = r.width / g.w;
        return [(g.left + (arguments[2] + 0.5) * g.cell) * s - r.width / 2, (g.top + (arguments[1] + 0.5) * g.cell) * s - r.height / 2];""",
                                   selector, row, col)
    canvas = driver.find_element(By.CSS_SELECTOR, selector)
    ActionChains(driver).move_to_element_with_offset(canvas, round(offset[0]), round(offset[1])).perform()
    return wait(driver, lambda d: by_id(d, "tip").is_displayed() and by_id(d, "tip").text, "the tip of a map cell")


def error_statuses(driver: Any) -> list[int]:
    """The HTTP statuses of the page's failed requests so far, from Chromium's console (which it clears)."""
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert all("/api/" in m and "status of 4" in m for m in severe), severe  # nothing else: no script error
    return [int(m.split("status of ")[1][:3]) for m in severe]


def similarity(driver: Any) -> Any:
    """The output similarity's full value (data-value), read in one go: each answer redraws it."""
    return driver.execute_script("const e = document.getElementById('similarity'); return e && e.dataset.value")


def tokens(driver: Any) -> list[str]:
    """The token buttons' words, read in one go (the page may redraw them between two reads)."""
    return driver.execute_script("return [...document.querySelectorAll('#tokens .tok')].map(e => e.textContent)")


def step_the_tutorial_comes_first_with_the_worked_example(page: Any) -> None:
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#tut-mats [data-mat=weights] td"), "the tutorial's weights")
    assert by_id(page, "view-tutorial").is_displayed() and not by_id(page, "view-heads").is_displayed()
    cells = page.find_elements(By.CSS_SELECTOR, "#tut-mats [data-mat=weights] tbody tr:first-child td")
    assert [c.text for c in cells] == ["0.881", "0.119"]
    assert [float(c.get_attribute("data-value")) for c in cells] == pytest.approx([0.8807970779778823, 0.11920292202211755], abs=1e-15)
    scaled = page.find_elements(By.CSS_SELECTOR, "#tut-mats [data-mat=scaled] tbody tr:first-child td")
    assert [c.text for c in scaled] == ["14.000", "12.000"]
    assert "0.881" in by_id(page, "tut-story").text and "0.119" in by_id(page, "tut-story").text
    # the steps are navigable: Next walks the matrices, then on into the causal mask's chapter
    before = by_id(page, "tut-where").text
    by_id(page, "tut-next").click()
    assert by_id(page, "tut-where").text != before
    page.find_element(By.CSS_SELECTOR, "#tut-chapters [data-chapter=causal]").click()
    masked = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#tut-mats [data-mat=masked] tbody tr:first-child td"), "the mask")
    assert [c.text for c in masked][1:] == ["−∞", "−∞"]
    # nothing ran a model yet
    names = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [n for n in names if "/api/analyze" in n]


def step_a_fresh_page_reads_an_ordinary_sentence_with_the_real_model(page: Any, served: tuple[str, Studio]) -> None:
    from qkv.analysis import explain

    assert Select(by_id(page, "model")).first_selected_option.get_attribute("value") == "minilm"
    assert by_id(page, "focus-line").text == catalogue("studio.type_first", "en")
    type_text(page, LONG)
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .card")) == 72
         and d.find_elements(By.CSS_SELECTOR, "#grid-0-0[data-drawn]"), "the 6 × 12 maps of the long sentence")
    toks = tokens(page)
    assert len(toks) > 25 and "librarian" in toks and "error" not in by_id(page, "status").get_attribute("class")
    assert "all-MiniLM-L6-v2" in by_id(page, "status").text and not by_id(page, "focus-line").text.startswith("Type")
    # pointing at a cell of a small map shows its query, key and weight (the analysis's, 16-bit on the way)
    slot = served[1].slot("minilm")
    with slot.lock:
        maps = explain(LONG, model=slot.model).maps
    row, col = toks.index("librarian"), toks.index("door")
    words = point_at(page, "#grid-1-3 canvas", row, col)
    assert words.startswith("L1 H3") and "“librarian”" in words and "“door”" in words, words
    shown = float(words.rsplit(" ", 1)[1])
    assert abs(shown - maps[1, 3, row, col]) <= 0.0005 + 1 / 65535, (words, maps[1, 3, row, col])
    # a reload (or the address shared) restores the text and the view from the address
    assert "text=The+old+librarian" in page.current_url and "view=heads" in page.current_url
    page.refresh()
    wait(page, lambda d: tokens(d) == toks and d.find_elements(By.CSS_SELECTOR, "#grid-0-0[data-drawn]"),
         "the long sentence again after the reload")
    assert by_id(page, "text").get_attribute("value") == LONG and by_id(page, "view-heads").is_displayed()


def step_the_toy_models_limit_offers_the_real_model_one_click_away(page: Any) -> None:
    Select(by_id(page, "model")).select_by_value("toy")
    switch = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#status button.switch"), "the toy model's refusal")[0]
    status = by_id(page, "status").text
    assert "at most 16 words" in status and "all-MiniLM-L6-v2" in status and "error" in by_id(page, "status").get_attribute("class")
    assert by_id(page, "focus-line").text == "" and tokens(page) == []  # no stale hint, no tokens of another answer
    assert not by_id(page, "heads-empty").text and not page.find_elements(By.CSS_SELECTOR, "#grid .card")
    assert error_statuses(page) == [400]
    switch.click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#grid-0-0[data-drawn]") and "librarian" in tokens(d),
         "the real model's maps after one click")
    assert Select(by_id(page, "model")).first_selected_option.get_attribute("value") == "minilm"


def step_typing_a_sentence_draws_every_head(page: Any) -> None:
    type_text(page, TEXT)
    wait(page, lambda d: tokens(d) == TOKENS, "the word pieces of the sentence")
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .card")) == 72
         and d.find_elements(By.CSS_SELECTOR, "#grid-0-0[data-drawn]"), "the 6 × 12 maps")
    assert by_id(page, "view-heads").is_displayed()
    assert str(LIMITS["max_tokens"]) in by_id(page, "status").text
    # a drawn card: a square map with its tokens' labels (9 tokens: small enough to label), not blank
    first = by_id(page, "grid-0-0")
    assert page.execute_script("""const c = document.querySelector('#grid-0-0 canvas');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let dark = 0; for (let i = 0; i < px.length; i += 4) if (px[i] < 200) dark++;
        return [c.width === c.height, c.width > 40, c.dataset.labels, dark > 0];""") == [True, True, "1", True]
    assert first.find_element(By.CSS_SELECTOR, ".card-stats").text.startswith("H ")
    # sorting by entropy puts the most focused head first
    Select(by_id(page, "sort")).select_by_value("entropy")
    first_sorted = page.execute_script("""return [...document.querySelectorAll('#grid .card')]
        .sort((a, b) => +a.style.order - +b.style.order)[0].id""")
    assert first_sorted == "grid-0-2"  # L0 H2: the previous-token head, entropy near 0
    Select(by_id(page, "sort")).select_by_value("order")


def step_choosing_she_highlights_the_heads_linking_her_to_alice(page: Any, served: tuple[str, Studio]) -> None:
    from qkv.analysis import explain

    seen = analyses(page)
    page.find_element(By.CSS_SELECTOR, f"#tokens .tok[data-index='{SHE}']").click()
    wait(page, lambda d: analyses(d) > seen and d.find_elements(By.CSS_SELECTOR, "#tokens .tok.focus"), "the focus")
    assert page.find_element(By.CSS_SELECTOR, "#tokens .tok.focus").text == "she"
    assert page.find_element(By.CSS_SELECTOR, "#tokens .tok.target").text == "alice"
    studio = served[1]
    slot = studio.slot("minilm")
    with slot.lock:  # the server's model: nobody else's forward pass while we run ours
        want = explain(TEXT, f"#{SHE}", f"#{ALICE}", model=slot.model).top_heads(8)
    linked = {(int(c.get_attribute("data-layer")), int(c.get_attribute("data-head")))
              for c in page.find_elements(By.CSS_SELECTOR, "#grid .card.linked")}
    assert linked == {(layer, head) for layer, head, _ in want}
    best = by_id(page, f"grid-{want[0][0]}-{want[0][1]}")
    assert best.get_attribute("data-rank") == "0" and best.find_element(By.CSS_SELECTOR, ".card-badge").text


def step_one_head_steps_to_the_softmax_of_trace_model(page: Any, served: tuple[str, Studio]) -> None:
    from qkv.glass import trace_model

    best = page.find_element(By.CSS_SELECTOR, "#grid .card.linked[data-rank='0']")
    layer, head = int(best.get_attribute("data-layer")), int(best.get_attribute("data-head"))
    best.click()
    glass = f"#glass[data-layer='{layer}'][data-head='{head}'][data-token='{SHE}']"
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, glass), "the glass box of the head")
    assert by_id(page, "view-head").is_displayed()
    while by_id(page, "glass").get_attribute("data-step") != "weights":
        by_id(page, "step-next").click()
    cells = page.find_elements(By.CSS_SELECTOR, "#glass td[data-step=weights]")
    assert all(c.is_displayed() for c in cells)
    slot = served[1].slot("minilm")
    with slot.lock:
        t = trace_model(TEXT, slot.model, layer=layer, head=head)
    row = t.weights[SHE]
    assert [float(c.get_attribute("data-value")) for c in cells] == row.tolist()  # exactly: the same float64s
    assert [c.text for c in cells] == [f"{w:.3f}" for w in row]
    scaled = [float(c.get_attribute("data-value")) for c in page.find_elements(By.CSS_SELECTOR, "#glass td[data-step=scaled]")]
    assert scaled == t.scaled[SHE].tolist()
    assert '"she"' in by_id(page, "head-story").text
    # the big map: pointing at a cell shows the trace's own float64 weight
    words = point_at(page, "#big", SHE, ALICE)
    assert words == catalogue("studio.hover_cell", "en", name=f"L{layer} H{head}", q="she", qi=SHE, k="alice", ki=ALICE,
                              w=f"{t.weights[SHE, ALICE]:.3f}")


def step_knocking_a_head_out_changes_the_output_and_undo_restores_it(page: Any) -> None:
    by_id(page, "tab-intervene").click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#iv-grid .card[data-drawn]"), "the intervention's maps")
    assert similarity(page) == "1"
    by_id(page, "iv-grid-1-3").click()
    wait(page, lambda d: similarity(d) is not None and float(similarity(d)) < 1, "the output's change")
    assert by_id(page, "iv-grid-1-3").get_attribute("class").split().count("off") == 1
    change = {(int(c.get_attribute("data-layer")), int(c.get_attribute("data-head"))): float(c.get_attribute("data-change"))
              for c in page.find_elements(By.CSS_SELECTOR, "#iv-grid .card")}
    assert max(v for (layer, _), v in change.items() if layer <= 1) == 0  # its own layer and those before: as they were
    assert max(v for (layer, _), v in change.items() if layer > 1) > 0  # the layers after it read its change
    assert page.find_elements(By.CSS_SELECTOR, "#iv-lines li")
    by_id(page, "undo").click()
    wait(page, lambda d: similarity(d) == "1", "the undo")
    assert not page.find_elements(By.CSS_SELECTOR, "#iv-grid .card.off")


def step_editing_a_sentence_pair_under_a_chosen_token_sends_no_stale_index(page: Any) -> None:
    by_id(page, "tab-heads").click()
    by_id(page, "pair").click()
    second = by_id(page, "second")
    second.send_keys("She smiled at him because he had helped her.")
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens .tok.seg-b")) > 8, "the pair's word pieces")
    seen = analyses(page)
    last = page.find_elements(By.CSS_SELECTOR, "#tokens .tok.seg-b")[-3]  # a token near the end of the second text
    last.click()
    wait(page, lambda d: analyses(d) > seen and d.find_elements(By.CSS_SELECTOR, "#tokens .tok.seg-b.focus"), "the focus")
    seen = analyses(page)
    second.send_keys(Keys.CONTROL, "a")
    second.send_keys("She smiled.")  # shorter: that token index is no longer in the text
    wait(page, lambda d: analyses(d) > seen and tokens(d)[-4:] == ["she", "smiled", ".", "[SEP]"], "the shortened pair")
    assert "error" not in by_id(page, "status").get_attribute("class") and error_statuses(page) == []
    by_id(page, "pair").click()
    second.send_keys(Keys.CONTROL, "a")
    second.send_keys(Keys.BACKSPACE)
    wait(page, lambda d: not d.find_elements(By.CSS_SELECTOR, "#tokens .tok.seg-b"), "the single text again")


def step_the_page_switches_to_chinese_without_reloading(page: Any) -> None:
    marker = page.execute_script("return window.qkvTestMarker = Math.random()")
    by_id(page, "lang-zh").click()
    wait(page, lambda d: by_id(d, "tab-intervene").text == catalogue("studio.tab_intervene", "zh"), "the Chinese labels")
    assert page.find_element(By.TAG_NAME, "html").get_attribute("lang") == "zh-CN"
    assert by_id(page, "undo").get_attribute("textContent") == catalogue("studio.undo", "zh")
    assert page.execute_script("return window.qkvTestMarker") == marker  # the same page, not a reload
    by_id(page, "lang-en").click()
    wait(page, lambda d: by_id(d, "tab-intervene").text == catalogue("studio.tab_intervene", "en"), "the English labels")


def step_markup_in_the_text_is_shown_as_text(page: Any) -> None:
    by_id(page, "tab-heads").click()
    markup = "<img src=x onerror=alert(1)>"
    type_text(page, markup)
    wait(page, lambda d: tokens(d)[:4] == ["[CLS]", "<", "im", "##g"], "the markup's word pieces")
    assert page.find_elements(By.TAG_NAME, "img") == []
    with pytest.raises(NoAlertPresentException):
        page.switch_to.alert.text
    assert by_id(page, "text").get_attribute("value") == markup


def step_a_text_over_the_limit_is_a_message_in_the_page(page: Any) -> None:
    type_text(page, "a" * 1200)
    wait(page, lambda d: f"at most {LIMITS['max_chars']}" in by_id(d, "status").text, "the limit's message")
    status = by_id(page, "status")
    assert "1200" in status.text and "error" in status.get_attribute("class").split()
    assert "over" in by_id(page, "count").get_attribute("class").split()


def step_no_console_errors_and_no_request_leaves_the_machine(page: Any, served: tuple[str, Studio]) -> None:
    # the one refusal provoked since the toy model's: Chromium logs a 413 answer as a failed resource
    assert error_statuses(page) in ([], [413])
    names = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert names and all(n.startswith(served[0] + "/") for n in names), names


@pytest.mark.slow  # a real model in Chromium, every view (22 s); CI's slow tier runs it
def test_a_learners_path_through_the_studio(page: Any, served: tuple[str, Studio]) -> None:
    """The steps above, in order, as one test: each leaves the page where the next one starts, so
    they must not be split between test workers."""
    step_the_tutorial_comes_first_with_the_worked_example(page)
    step_a_fresh_page_reads_an_ordinary_sentence_with_the_real_model(page, served)
    step_the_toy_models_limit_offers_the_real_model_one_click_away(page)
    step_typing_a_sentence_draws_every_head(page)
    step_choosing_she_highlights_the_heads_linking_her_to_alice(page, served)
    step_one_head_steps_to_the_softmax_of_trace_model(page, served)
    step_knocking_a_head_out_changes_the_output_and_undo_restores_it(page)
    step_editing_a_sentence_pair_under_a_chosen_token_sends_no_stale_index(page)
    step_the_page_switches_to_chinese_without_reloading(page)
    step_markup_in_the_text_is_shown_as_text(page)
    step_a_text_over_the_limit_is_a_message_in_the_page(page)
    step_no_console_errors_and_no_request_leaves_the_machine(page, served)
