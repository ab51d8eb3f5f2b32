"""`python -m trainer.plot RUN`: a metrics file (CSV or JSON lines) drawn into a PNG of loss,
throughput and learning rate; without matplotlib, one line naming the plot extra."""

import sys

import pytest

from trainer import plot
from trainer.metrics import MetricsLog, StepMetrics

pytestmark = pytest.mark.timeout(30)


def write_run(path, tokens: bool) -> None:
    log = MetricsLog(path, writer_class=False, say=lambda _: None)
    for step in range(1, 11):
        rate = 100.0 + step
        log.step(StepMetrics(step=step, epoch=(step - 1) // 5, step_in_epoch=(step - 1) % 5 + 1, loss=3.0 / step,
                             lr=1e-3 * step / 10, grad_norm=1.0, loss_scale=None, skipped=False, samples_per_s=rate,
                             tokens_per_s=64 * rate if tokens else None, elapsed_s=0.1 * step))
        if step % 5 == 0:
            log.epoch({"step": step, "epoch": step // 5 - 1, "train_loss": 1.0, "val_loss": 0.9})
    log.close()


@pytest.mark.parametrize("name, tokens", [("run.csv", False), ("run.jsonl", True)])
def test_a_run_is_drawn_into_a_png_of_its_three_panels(tmp_path, capsys, name, tokens):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    write_run(tmp_path / name, tokens)
    assert plot.main([str(tmp_path / name)]) == 0
    out = tmp_path / name.replace(".csv", ".png").replace(".jsonl", ".png")
    assert capsys.readouterr().out == f"{out}\n"
    image = matplotlib.image.imread(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[:2] == (900, 800)
    figure = plot.figure_of(tmp_path / name)
    loss, rate, lr = figure.axes
    assert [line.get_label() for line in loss.lines] == ["step loss", "epoch train loss", "validation loss"]
    assert list(loss.lines[0].get_ydata()) == [3.0 / s for s in range(1, 11)]
    assert list(loss.lines[2].get_xdata()) == [5, 10] and rate.get_ylabel() == ("tokens/s" if tokens else "samples/s")
    assert list(rate.lines[0].get_ydata())[-1] == (64 * 110.0 if tokens else 110.0)
    assert list(lr.lines[0].get_ydata()) == pytest.approx([1e-3 * s / 10 for s in range(1, 11)])


def test_a_file_without_steps_and_a_missing_matplotlib_are_one_line_errors(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty.csv").write_text("kind,step,epoch\n")
    assert plot.main([str(tmp_path / "empty.csv")]) == 1
    assert capsys.readouterr().err == (f"trainer.plot: {tmp_path / 'empty.csv'} holds no step rows (write it with "
                                       f"python -m trainer --metrics PATH)\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.main([str(tmp_path / "empty.csv")]) == 1
    assert capsys.readouterr().err == ("trainer.plot: trainer.plot needs matplotlib, which is not installed: "
                                       "pip install -e '.[plot]' (or pip install 'ringweave[plot]')\n")
