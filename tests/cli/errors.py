"""What the CLI tests share: running ``qkv`` in-process and reading the error it ends with."""

from __future__ import annotations

from qkv.cli import main


def error_line(capsys, argv: list[str]) -> str:
    """The last line ``qkv <argv>`` writes to stderr, after checking it exited 2 with no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    print(line)
    return line
