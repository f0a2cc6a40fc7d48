"""Progress where stderr is no terminal (a log, a pipe): Rich draws nothing until the end there, so the
commands write plain lines instead, on stderr, never on stdout (which holds tables and --json)."""

from mlxb.commands import _common as C


def test_progress_without_a_terminal_writes_lines_to_stderr(capsys):
    assert not C.err_console.is_terminal  # pytest captures stderr
    with C.progress() as prog:
        t = prog.add_task("golden cases", total=3)
        prog.advance(t)
        prog.update(t, description="golden cases: tiny-gemma3")
        prog.advance(t, 2)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("golden cases 0/3")
    assert any(x.startswith("golden cases: tiny-gemma3 1/3") for x in lines)
    assert any(x.startswith("golden cases: tiny-gemma3 3/3") for x in lines)  # the last count, as a line


def test_status_without_a_terminal_writes_each_text(capsys):
    with C.status("benchmarking ...") as st:
        st.update("benchmarking: B=8 repeat 1/2")
    out, err = capsys.readouterr()
    assert out == ""
    assert [x.split(" [")[0] for x in err.strip().splitlines()] == ["benchmarking ...", "benchmarking: B=8 repeat 1/2"]
