import io
import math
import re

from rich.console import Console

from trainer.observe.recorders import ConsoleRecorder, format_value


def _plain_console():
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def test_format_value():
    assert format_value(2.31412) == "2.314"
    assert format_value(0.81) == "0.81"
    assert format_value(1e-3) == "1.0e-03"
    assert format_value(15234.0) == "15.2k"
    assert format_value(999_970.0) == "1M"
    assert format_value(4096) == "4096"
    assert format_value(12_345_678) == "12.3M"
    assert format_value(0.0) == "0"
    assert format_value(math.nan) == "nan"
    assert format_value(-math.inf) == "-inf"


def test_record_prints_a_line_with_the_values():
    console = _plain_console()
    recorder = ConsoleRecorder(100, console=console)
    assert not recorder.is_live  # not a terminal: log lines only
    recorder.record(
        "train", 10, {"loss": 2.3141, "grad_norm": 0.81, "lr": 1e-3, "tokens_per_s": 15234.0}
    )
    recorder.record("valid/lm", 10, {"loss": math.nan})
    recorder.close()

    lines = console.file.getvalue().splitlines()
    assert lines == [
        "train step 10 | loss 2.314 | grad_norm 0.81 | lr 1.0e-03 | tok/s 15.2k",
        "valid/lm step 10 | loss nan",
    ]


def test_advance_writes_nothing_per_step():
    console = _plain_console()
    recorder = ConsoleRecorder(None, console=console)
    recorder.record("train", 0, {"loss": 1.0})
    size = len(console.file.getvalue())
    for step in range(1, 10_001):
        recorder.advance(step)
    assert len(console.file.getvalue()) == size
    recorder.close()
    assert len(console.file.getvalue()) == size


def test_live_bar_on_a_terminal_shows_step_and_train_metrics():
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    recorder = ConsoleRecorder(100, console=console)
    assert recorder.is_live
    recorder.rewind(20)  # resumed at step 20
    for step in range(21, 31):
        recorder.advance(step)
    recorder.record("train", 30, {"loss": 2.5, "targets_per_s": 1234.0})
    recorder.close()  # final redraw picks up the stored step
    output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # no ANSI codes
    assert "step 30/100" in output
    assert "loss 2.5 | 1.23k tgt/s" in output
    assert "train step 30 | loss 2.5 | tgt/s 1.23k" in output


def test_show_progress_false_disables_the_bar():
    console = Console(file=io.StringIO(), force_terminal=True)
    recorder = ConsoleRecorder(10, console=console, show_progress=False)
    recorder.advance(1)
    recorder.close()
    assert not recorder.is_live
    assert console.file.getvalue() == ""
