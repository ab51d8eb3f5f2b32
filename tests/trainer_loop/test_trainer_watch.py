"""Watching a run of trainer.loop.fit (one rank, the real ddp strategy): the progress line (lr, grad
norm, loss scale, ETA, tokens/s), the bar on a terminal, checkpoint saves and loads in the log,
the per-step metrics file (CSV, JSON lines, TensorBoard through a stand-in writer), and the best
checkpoint that save_best keeps."""

import io
import json
import re
import shutil
import sys
import types

import pytest
from threadpoolctl import threadpool_limits

from trainer.data import Split, make_synthetic
from trainer.loop import Callback, fit
from trainer.metrics import read_metrics
from trainer.nn import mlp
from trainer.optim import WarmupCosine
from trainer.sharding import make_strategy
from trainer.sharding.base import TrainConfig

pytestmark = pytest.mark.timeout(60)

STEPS = 7  # 100 rows in batches of 16: 7 steps per epoch, the last of 4 rows


@pytest.fixture(autouse=True)
def one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def split() -> Split:
    x, y = make_synthetic(130, in_dim=8, num_classes=3, seed=3, class_sep=1.0)
    return Split(x[30:], y[30:], x[:30], y[:30], 3)


class Record(Callback):
    """Every step's StepMetrics and StepResult; optionally replaces an epoch's metric by a scripted value."""

    def __init__(self, script=None):
        self.metrics, self.results, self.script = [], [], script or {}

    def on_step_end(self, state):
        self.metrics.append(state.metrics)
        self.results.append(state.result)

    def on_epoch_end(self, state):
        for name, values in self.script.items():
            setattr(state.epoch_stats, name, values[state.epoch])


class Terminal(io.StringIO):
    def isatty(self):
        return True


def config(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 5e-3, "warmup_steps": 3, "total_steps": 4 * STEPS, "min_lr": 1e-4, "seed": 2, **kw})


async def watch(ranks, data, *, epochs=2, record=None, stream=None, cfg=None, world=1, **kw):
    """fit under ddp at ``world`` ranks; returns (rank 0's history, what rank 0 showed, the Record)."""
    record = record or Record()
    stream = stream if stream is not None else io.StringIO()
    cfg = cfg or config()

    async def body(group):
        strategy = make_strategy("ddp", mlp(8, (16,), 3, pad_to=group.size), cfg, group)
        await strategy.setup()
        try:
            return await fit(strategy, data, cfg, epochs=epochs, global_batch_size=16, callbacks=[record],
                             group=group, progress_stream=stream, summary_stream=io.StringIO(), **kw)
        finally:
            strategy.close()

    results = await ranks(world, body, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result  # as fit raised it, not in an ExceptionGroup
    return results[0], stream.getvalue(), record


LINE = re.compile(r"epoch (\d)/(\d) step (\d)/7 loss ([\d.]+) lr ([\d.e+-]+) grad norm ([\d.e+-]+)( scale (\d+))? "
                  r"\| ([\d,]+) samples/s \| ETA (\d+:\d\d)$")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_the_progress_line_shows_lr_grad_norm_the_loss_scale_where_used_and_an_eta(ranks, dtype):
    cfg = config(param_dtype=dtype)
    _, err, rec = await watch(ranks, split(), cfg=cfg, log_every=3)
    lines = [LINE.match(line) for line in err.splitlines() if " step " in line]
    assert all(lines) and len(lines) == 6, err  # steps 3, 6, 7 of each epoch
    schedule = WarmupCosine(cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr)
    for m in lines:
        epoch, k = int(m[1]) - 1, int(m[3])
        step = epoch * STEPS + k
        assert m[5] == f"{schedule(step - 1):.2e}"  # the lr this step used
        assert m[6] == f"{rec.results[step - 1].grad_norm:.3g}" and rec.results[step - 1].grad_norm > 0
        assert (m[8] == "65536") if dtype == "float16" else m[7] is None
    assert lines[-1][10] == "0:00" and lines[0][10] != "?"


async def test_a_terminal_gets_one_redrawn_bar_and_log_lines_start_on_their_own_line(ranks, tmp_path):
    _, out, _ = await watch(ranks, split(), epochs=1, stream=Terminal(), checkpoint_dir=str(tmp_path / "c"),
                            checkpoint_every=4, log_every=1)
    assert "\r\x1b[Kepoch 1/1 [" in out and "] 7/7 loss " in out and not re.search("^epoch 1/1 step", out, re.M)
    assert f"\nsaved checkpoint {tmp_path / 'c'}/step-00000004 (optimizer step 4, epoch 1, step 4 of 7)\n" in out
    assert "\nepoch 1/1: train loss" in out


async def test_every_checkpoint_save_and_load_is_logged_with_its_path_and_step(ranks, tmp_path):
    ckpt = tmp_path / "c"
    _, err, _ = await watch(ranks, split(), checkpoint_dir=str(ckpt), checkpoint_every=3, keep_last=9)
    saved = re.findall(r"^saved checkpoint (\S+) \(optimizer step (\d+), (.*)\)$", err, re.M)
    assert saved == [(f"{ckpt}/step-00000003", "3", "epoch 1, step 3 of 7"),
                     (f"{ckpt}/step-00000006", "6", "epoch 1, step 6 of 7"),
                     (f"{ckpt}/step-00000007", "7", "after epoch 1"),
                     (f"{ckpt}/step-00000009", "9", "epoch 2, step 2 of 7"),
                     (f"{ckpt}/step-00000012", "12", "epoch 2, step 5 of 7"),
                     (f"{ckpt}/step-00000014", "14", "after epoch 2")]
    _, err, _ = await watch(ranks, split(), epochs=3, checkpoint_dir=str(ckpt), resume=True)
    assert f"resumed from {ckpt}/step-00000014: epoch 3, step 0 of 7 (optimizer step 14)" in err
    assert f"saved checkpoint {ckpt}/step-00000021 (optimizer step 21, after epoch 3)" in err


@pytest.mark.parametrize("name", ["m.csv", "m.jsonl"])
async def test_the_metrics_file_holds_every_step_and_every_epoch(ranks, tmp_path, name):
    history, err, rec = await watch(ranks, split(), metrics=str(tmp_path / "runs" / name))
    rows = read_metrics(tmp_path / "runs" / name)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 2 * STEPS + 1))
    for row, m, result in zip(steps, rec.metrics, rec.results):
        assert row["loss"] == result.loss and row["grad_norm"] == result.grad_norm and row["lr"] == m.lr
        assert row["epoch"] == m.epoch and row["samples_per_s"] == m.samples_per_s > 0 and row["skipped"] == 0
        assert "loss_scale" not in row and "tokens_per_s" not in row  # float32, and rows are not token windows
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [(r["step"], r["epoch"]) for r in epochs] == [(7, 0), (14, 1)]
    for row, stats in zip(epochs, history.epochs):
        assert (row["val_loss"], row["val_acc"], row["train_loss"]) == (stats.val_loss, stats.val_acc,
                                                                         stats.train_loss)
    assert err.count("no TensorBoard writer") == 1  # this machine's venv has none; said once, not per step


async def test_a_resumed_run_keeps_its_metrics_up_to_the_checkpoint_and_appends(ranks, tmp_path):
    ckpt, path = tmp_path / "c", tmp_path / "m.jsonl"
    await watch(ranks, split(), checkpoint_dir=str(ckpt), checkpoint_every=3, keep_last=9, metrics=str(path))
    for later in ("step-00000012", "step-00000014"):  # the attempt died after step 14, its last save at 9
        shutil.rmtree(ckpt / later)
    _, _, rec = await watch(ranks, split(), checkpoint_dir=str(ckpt), resume=True, metrics=str(path))
    rows = read_metrics(path)
    assert [(r["kind"], r["step"]) for r in rows] == ([("step", s) for s in range(1, 8)] + [("epoch", 7)]
                                                      + [("step", s) for s in range(8, 15)] + [("epoch", 14)])
    assert [r["loss"] for r in rows[10:15]] == [r.loss for r in rec.results]  # steps 10..14 from the resumed run


class FakeSummaryWriter:
    """What TensorBoard's SummaryWriter is asked (torch.utils.tensorboard's and tensorboardX's API)."""
    made = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeSummaryWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


async def test_tensorboard_event_files_where_a_writer_is_importable(ranks, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not torch's: the stand-in tensorboardX below
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
    FakeSummaryWriter.made.clear()
    history, err, rec = await watch(ranks, split(), metrics=str(tmp_path / "m.csv"))
    [writer] = FakeSummaryWriter.made
    assert writer.log_dir == str(tmp_path / "m-tensorboard") and writer.purge_step is None and writer.closed
    by_tag = {}
    for tag, value, step in writer.scalars:
        by_tag.setdefault(tag, []).append((step, value))
    assert by_tag["train/loss"] == [(s + 1, r.loss) for s, r in enumerate(rec.results)]
    assert by_tag["train/lr"] == [(m.step, m.lr) for m in rec.metrics]
    assert by_tag["val/loss"] == [(7, history.epochs[0].val_loss), (14, history.epochs[1].val_loss)]
    assert "no TensorBoard writer" not in err


async def test_without_a_writer_it_says_so_once_and_writes_the_file(ranks, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    _, err, _ = await watch(ranks, split(), metrics=str(tmp_path / "m.jsonl"))
    assert err.count(f"metrics: no TensorBoard writer here (pip install tensorboard, or tensorboardX); writing "
                     f"{tmp_path / 'm.jsonl'} only") == 1
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2 * STEPS + 2


@pytest.mark.parametrize("metric, values, best_epoch", [
    ("val_loss", [0.5, 0.3, 0.4, 0.35, 0.6, 0.45, 0.31], 1),  # lowest wins
    ("val_acc", [0.5, 0.9, 0.7, 0.8, 0.6, 0.85, 0.89], 1),  # highest wins
])
async def test_save_best_keeps_the_best_checkpoint_and_pruning_never_takes_it(ranks, tmp_path, metric, values,
                                                                               best_epoch):
    ckpt = tmp_path / "c"
    best = f"{ckpt}/step-{(best_epoch + 1) * STEPS:08d}"
    history, err, _ = await watch(ranks, split(), epochs=5, record=Record({metric: values}), keep_last=1,
                                  checkpoint_dir=str(ckpt), save_best=metric)
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{(best_epoch + 1) * STEPS:08d}", "step-00000035"]
    assert history.best == {"metric": metric, "mode": "min" if metric == "val_loss" else "max",
                            "value": values[best_epoch], "step": (best_epoch + 1) * STEPS, "path": best}
    meta = json.loads((ckpt / "step-00000035" / "metadata.json").read_text())
    assert meta["extra"]["loop"]["best"] == history.best
    assert f"; best {metric} {values[best_epoch]:.4f}: {best}" in err
    # a resumed run knows the best so far: a worse value in epochs 6 and 7 does not replace it
    history, _, _ = await watch(ranks, split(), epochs=7, record=Record({metric: values}), keep_last=1,
                                checkpoint_dir=str(ckpt), save_best=metric, resume=True)
    assert history.best["path"] == best and sorted(p.name for p in ckpt.iterdir()) == [
        f"step-{(best_epoch + 1) * STEPS:08d}", "step-00000049"]


async def test_save_best_needs_a_checkpoint_dir_and_a_metric_the_run_computes(ranks, tmp_path):
    with pytest.raises(ValueError, match="save_best='val_loss' needs a checkpoint_dir"):
        await watch(ranks, split(), save_best="val_loss")
    with pytest.raises(ValueError, match="save_best='loss' needs a checkpoint_dir and one of"):
        await watch(ranks, split(), save_best="loss", checkpoint_dir=str(tmp_path / "a"))
    x, y = make_synthetic(100, in_dim=8, num_classes=3, seed=3)
    no_val = Split(x, y, x[:0], y[:0], 3)
    with pytest.raises(ValueError, match="save_best watches 'val_loss', which this run does not compute"):
        await watch(ranks, no_val, save_best="val_loss", checkpoint_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"metrics file 'm.txt' must end in .csv, .jsonl or .ndjson"):
        await watch(ranks, split(), metrics="m.txt")


async def test_token_windows_report_tokens_per_second(ranks):
    rows = split()  # each sample a window of 8 tokens, as trainer.text.TextSplit says with tokens_per_sample:
    data = types.SimpleNamespace(train=rows.train, val=rows.val, tokens_per_sample=8)
    history, err, rec = await watch(ranks, data, epochs=1, log_every=7)
    assert re.search(r"step 7/7 .* \| [\d,]+ tokens/s \| ETA", err) and "samples/s" not in err
    stats = history.epochs[0]
    assert stats.tokens_per_s == pytest.approx(8 * stats.samples_per_s)
    assert f"| {stats.tokens_per_s:,.0f} tokens/s, batch 16" in err
    assert rec.metrics[-1].tokens_per_s == pytest.approx(8 * rec.metrics[-1].samples_per_s)
    assert history.tokens_per_s == pytest.approx(8 * history.samples_per_s)


async def test_at_two_ranks_rank_0_writes_the_file_and_a_path_it_cannot_write_stops_every_rank(ranks, tmp_path):
    history, _, _ = await watch(ranks, split(), world=2, epochs=1, metrics=str(tmp_path / "m.jsonl"))
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == list(range(1, STEPS + 1)) + [STEPS]
    (tmp_path / "file").write_text("")
    cfg = config()

    async def body(group):
        strategy = make_strategy("ddp", mlp(8, (16,), 3, pad_to=2), cfg, group)
        await strategy.setup()
        try:
            return await fit(strategy, split(), cfg, epochs=1, global_batch_size=16, group=group,
                             metrics=str(tmp_path / "file" / "m.csv"), progress_stream=io.StringIO(),
                             summary_stream=io.StringIO())
        finally:
            strategy.close()

    errors = await ranks(2, body, return_exceptions=True)
    for error in errors:  # every rank, before any step: none waits on a rank that died
        assert isinstance(error, OSError) and str(error).startswith(f"metrics file {tmp_path / 'file' / 'm.csv'}: "
                                                                    f"rank 0 cannot write it"), error
