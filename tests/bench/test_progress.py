import io

from veloxquant_mlx.bench.progress import Progress, Step


def test_plain_bar_prints_lines_to_a_file_and_null_bar_is_silent():
    stream = io.StringIO()
    with Progress(3, "speed", stream=stream, use_tqdm=False) as bar:
        bar.set_postfix_str("fp16 @ 512")
        for _ in range(3):
            bar.update()
    text = stream.getvalue()
    assert "speed [" in text and "3/3" in text and "fp16 @ 512" in text
    quiet = io.StringIO()
    with Progress(3, "speed", enabled=False, stream=quiet) as bar:
        bar.update()
    assert quiet.getvalue() == ""


def test_step_reports_duration_only_when_long():
    stream = io.StringIO()
    with Step("loading", stream=stream, min_s=0.0):
        pass
    assert "loading ..." in stream.getvalue() and "done in" in stream.getvalue()
    stream = io.StringIO()
    with Step("fast", stream=stream, min_s=60.0):
        pass
    assert "done in" not in stream.getvalue()
