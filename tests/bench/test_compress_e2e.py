"""bench/compress_e2e.py without its runs: the time to a target loss on hand-made curves, the
training clock read from a metrics file, the table and the plot of hand-made results, the
command's argument errors, the budget, the jobs it starts and the variants it runs (the trainer's
own refusals). The runs themselves need root and minutes: none here; never a speed asserted."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_compress_e2e", ROOT / "bench" / "compress_e2e.py")
e2e = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = e2e  # its dataclasses look their module up there
_spec.loader.exec_module(e2e)

pytestmark = pytest.mark.timeout(120)


# ---- time to target ------------------------------------------------------------------------


def test_time_to_target_interpolates_between_the_evaluations_around_the_crossing():
    points = [(10.0, 2.0), (20.0, 1.6), (30.0, 1.2), (40.0, 1.1)]
    # 1.4 lies halfway between 1.6 (20 s) and 1.2 (30 s)
    assert e2e.time_to_target(points, 1.4) == pytest.approx(25.0)
    assert e2e.time_to_target(points, 1.15) == pytest.approx(35.0)
    assert e2e.time_to_target(points, 1.1) == pytest.approx(40.0)  # reached exactly at the last evaluation
    assert e2e.time_to_target(points, 1.2) == pytest.approx(30.0)


def test_time_to_target_is_the_first_evaluation_when_it_is_reached_already_and_none_when_never():
    points = [(10.0, 2.0), (20.0, 1.6)]
    assert e2e.time_to_target(points, 2.5) == 10.0
    assert e2e.time_to_target(points, 1.59) is None
    assert e2e.time_to_target([], 1.0) is None


def test_time_to_target_takes_the_first_crossing_of_a_curve_that_rises_again():
    points = [(10.0, 2.0), (20.0, 1.0), (30.0, 1.5), (40.0, 0.9)]
    assert e2e.time_to_target(points, 1.2) == pytest.approx(10.0 + 0.8 * 10.0)


def test_the_training_clock_leaves_out_every_evaluation():
    rows = [
        {"kind": "step", "step": 1, "epoch": 0, "elapsed_s": 1.0},
        {"kind": "step", "step": 2, "epoch": 0, "elapsed_s": 2.0},
        {"kind": "epoch", "step": 2, "epoch": 0, "elapsed_s": 2.5, "val_loss": 3.0},   # 0.5 s evaluating
        {"kind": "step", "step": 3, "epoch": 1, "elapsed_s": 3.5},
        {"kind": "step", "step": 4, "epoch": 1, "elapsed_s": 4.5},
        {"kind": "epoch", "step": 4, "epoch": 1, "elapsed_s": 5.5, "val_loss": 2.0},   # 1 s evaluating
    ]
    c = e2e.curve(rows)
    assert c["points"] == [(2.0, 3.0), (4.0, 2.0)]
    assert c["train_s"] == pytest.approx(4.0) and c["steps"] == 4


def test_the_training_clock_reads_a_metrics_file_the_trainer_writes(tmp_path):
    from trainer.metrics import MetricsLog, StepMetrics, read_metrics
    path = tmp_path / "m.csv"
    log = MetricsLog(path, writer_class=False, say=lambda line: None)
    for step, elapsed in ((1, 0.5), (2, 1.0)):
        log.step(StepMetrics(step=step, epoch=0, step_in_epoch=step, loss=3.0, lr=1e-3, grad_norm=None,
                             loss_scale=None, skipped=False, samples_per_s=64.0, tokens_per_s=4096.0,
                             elapsed_s=elapsed))
    log.epoch({"step": 2, "epoch": 0, "elapsed_s": 1.75, "val_loss": 2.5})
    log.close()
    assert e2e.curve(read_metrics(path)) == {"points": [(1.0, 2.5)], "train_s": 1.0, "steps": 2}


# ---- the table and the plot -------------------------------------------------------------------


def _result(rate, framework, strategy, codec, points, train_s=10.0, steps=8):
    v = e2e.Variant(framework, strategy, codec)
    return {"rate": rate, "label": v.label, "framework": framework, "strategy": strategy, "codec": codec,
            "points": points, "train_s": train_s, "steps": steps, "wall_s": train_s + 5}


def _hand_made():
    # L = 1.0 (ddp none's last); the target with 1% is 1.01
    none = _result("100mbit", "ringweave", "ddp", "none", [(10, 2.0), (20, 1.5), (30, 1.0)], train_s=30)
    int8 = _result("100mbit", "ringweave", "ddp", "int8+ef", [(5, 2.0), (10, 1.5), (15, 1.005)], train_s=15)
    torch = _result("100mbit", "torch", "ddp", "none", [(20, 2.0), (40, 1.5), (60, 1.01)], train_s=60)
    worse = _result("100mbit", "ringweave", "ddp", "topk+ef", [(3, 2.0), (6, 1.5), (9, 1.05)], train_s=9)
    refused = {"rate": "100mbit", "label": "ddp powersgd", "framework": "ringweave", "strategy": "ddp",
               "codec": "powersgd", "refused": "compression 'powersgd' compresses matrices"}
    failed = {"rate": "100mbit", "label": "torch-ddp powersgd", "framework": "torch", "strategy": "ddp",
              "codec": "powersgd", "error": "exit 1", "wall_s": 3.0}
    fast = _result("1gbit", "ringweave", "ddp", "none", [(5, 2.0), (10, 1.2)])
    return [none, int8, torch, worse, refused, failed, fast]


def test_analysis_measures_every_variant_against_its_uncompressed_run_and_torch():
    rows = {r["label"]: r for r in e2e.analyse(_hand_made(), 0.01)["100mbit"]}
    # ddp none reaches 1.01 between 20 s (1.5) and 30 s (1.0): 20 + 0.49 / 0.5 x 10
    assert rows["ddp none"]["t_target"] == pytest.approx(29.8)
    assert rows["ddp none"]["t_strict"] == pytest.approx(30.0)
    # int8: between 10 s (1.5) and 15 s (1.005): 10 + 0.49 / 0.495 x 5; never reaches 1.0 itself
    t8 = 10 + 0.49 / 0.495 * 5
    assert rows["ddp int8+ef"]["t_target"] == pytest.approx(t8)
    assert rows["ddp int8+ef"]["t_strict"] is None
    assert rows["ddp int8+ef"]["x_uncompressed"] == pytest.approx(29.8 / t8)
    assert rows["ddp int8+ef"]["x_torch"] == pytest.approx(60.0 / t8)
    assert rows["ddp int8+ef"]["gap"] == pytest.approx(0.005)
    assert rows["torch-ddp"]["target"] == 1.0 and rows["torch-ddp"]["x_uncompressed"] == pytest.approx(29.8 / 60)
    assert rows["ddp topk+ef"]["t_target"] is None and rows["ddp topk+ef"]["gap"] == pytest.approx(0.05)
    assert "t_target" not in rows["ddp powersgd"]


def test_the_goals_name_the_best_codec_and_the_variants_that_end_worse():
    lines = e2e.goals("100mbit", e2e.analyse(_hand_made(), 0.01)["100mbit"])
    assert lines[0].startswith("100mbit: the best codec, ddp int8+ef,")
    assert f"{29.8 / (10 + 0.49 / 0.495 * 5):.2f}x sooner than ddp none (goal >= 2x: NOT met)" in lines[0]  # 1.99x
    assert "than torch-ddp (goal >= 2x: met)" in lines[1]
    assert "NOT met (ddp topk+ef +5.00%)" in lines[2] and "failed: torch-ddp powersgd" in lines[2]


def test_the_writer_makes_a_table_per_rate_and_a_plot(tmp_path):
    meta = {"title": "t", "command": "python bench/compress_e2e.py --rate 100mbit,1gbit", "machine": "m",
            "date": "d", "load_before": 1.0, "load_after": 2.0, "budget": "2 epochs", "deviation": None,
            "torch": "2.x", "tolerance": 0.01}
    said = e2e.write_outputs(str(tmp_path / "e2e.md"), meta, _hand_made())
    text = (tmp_path / "e2e.md").read_text()
    assert "### 100mbit" in text and "### 1gbit" in text
    row = next(line for line in text.splitlines() if line.startswith("| ddp int8+ef |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    t8 = 10 + 0.49 / 0.495 * 5
    assert cells[1:8] == ["1.0050", "+0.50%", f"{t8:.1f}", f"{29.8 / t8:.2f}", f"{60 / t8:.2f}", "not reached",
                          f"{8 * 64 * 64 / 15:,.0f}"]
    assert "| ddp powersgd | refused by the trainer: compression 'powersgd'" in text
    assert "| torch-ddp powersgd | failed: exit 1 |" in text
    assert "- 100mbit: the best codec, ddp int8+ef" in text
    if said[0].startswith("wrote"):
        assert (tmp_path / "compress_e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![validation loss against training time](compress_e2e.png)" in text
    else:
        assert said[0].startswith("plot skipped: matplotlib") and "![" not in text


def test_the_section_replaces_its_namesake_and_leaves_the_others(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# page\n\nintro\n\n## A\n\n- a\n\n## T\n\n(pending)\n\n## B\n\n- b\n")
    e2e.put_section(str(page), "## T\n\n- figures\n")
    assert page.read_text() == "# page\n\nintro\n\n## A\n\n- a\n\n## T\n\n- figures\n\n## B\n\n- b\n"
    e2e.put_section(str(page), "## C\n\n- c\n")
    assert page.read_text().endswith("## B\n\n- b\n\n## C\n\n- c\n")
    e2e.put_section(str(tmp_path / "new.md"), "## T\n\n- t\n")
    assert (tmp_path / "new.md").read_text() == "## T\n\n- t\n"


def test_the_skeleton_in_the_results_is_the_section_the_command_writes():
    text = (ROOT / "bench" / "results" / "compression.md").read_text()
    assert f"## {e2e.TITLE}\n" in text


def test_from_json_draws_the_same_table_again(tmp_path, capsys):
    meta = {"title": "t", "command": "c", "machine": "m", "date": "d", "load_before": 1.0, "load_after": 2.0,
            "budget": "b", "deviation": "1 epoch, not 2: the grid must fit 25 minutes", "torch": None}
    (tmp_path / "run.json").write_text(json.dumps({"meta": meta, "results": _hand_made()}))
    assert e2e.main(["--from-json", str(tmp_path / "run.json"), "--out", str(tmp_path / "again.md")]) == 0
    text = (tmp_path / "again.md").read_text()
    assert "(**1 epoch, not 2: the grid must fit 25 minutes**)" in text
    assert "| ddp none | 1.0000 | +0.00% | 29.8 |" in text


# ---- the command ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--rate", "fast"], "rates as tc spells them"),
    (["--rate", ""], "rates as tc spells them"),
    (["--strategies", "zero2"], "of ddp, fsdp"),
    (["--codecs", "int8+ef"], "must include none"),
    (["--codecs", "none,gzip"], "of none, int8+ef, topk+ef, powersgd"),
    (["--epochs", "0"], "must be a number > 0"),
    (["--epochs", "nan"], "must be a number > 0"),
    (["--evals-per-epoch", "0"], "must be a number > 0"),
    (["--windows", "10"], "at least one batch"),
    (["--tolerance", "1.5"], "--tolerance must be in [0, 1)"),
    (["--codec-warmup-epochs", "3"], "--codec-warmup-epochs must be in [0, --epochs]"),
    (["--out", "x.txt"], "must be a markdown file"),
    (["--variants", "ddp int8"], "of ddp none, ddp int8+ef"),
    (["--variants", "ddp int8+ef"], "must include ddp none: the target"),
    (["--variants", "torch-ddp"], "must include ddp none"),
    (["--variants", "fsdp none", "--strategies", "ddp"], "fsdp none: not in --strategies and --codecs"),
    (["--bucket-cap-mb", "0"], "must be a number > 0"),
])
def test_argument_errors_are_one_line_and_exit_2(argv, message, capsys):
    full = ["--out", "x.md", "--from-json", "x.json", *argv]
    with pytest.raises(SystemExit) as e:
        e2e.parse_args(full)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_out_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        e2e.parse_args([])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_the_budget_of_two_epochs_evaluated_four_times_each():
    b = e2e.Budget(2, 6554, 4, 0.5)
    assert (b.intervals, b.interval_windows, b.steps, b.epoch_steps) == (8, 1664, 208, 103)
    assert (b.lr_warmup_steps, b.codec_warmup_steps) == (51, 52)
    assert "208 steps (13,312 windows, 2.03 epochs)" in b.describe()
    small = e2e.Budget(1, 256, 2, 0.5)
    assert (small.intervals, small.interval_windows, small.steps) == (2, 128, 4)


def test_the_trainer_reads_the_budget_it_is_given():
    from trainer.cli import load_data, parse_args
    from trainer.loop import steps_per_epoch
    b = e2e.Budget(2, e2e.default_epoch_windows(), 4, 0.5)
    assert b.epoch_windows == 6554  # the pydoc text's training bytes / 64
    args = parse_args(e2e.trainer_args(e2e.Variant("ringweave", "fsdp", "topk+ef"), b, "m.csv"))
    data = load_data(args)
    assert len(data.train) == b.interval_windows and args.epochs == b.intervals
    assert args.epochs * steps_per_epoch(len(data.train), args.batch_size) == b.steps
    assert (args.strategy, args.warmup_steps, args.metrics) == ("fsdp", b.lr_warmup_steps, "m.csv")
    assert args.compression == "topk+ef" and args.compression_start == b.codec_warmup_steps
    assert args.compression_warmup_steps == 0  # an uncompressed start, not DGC's ramp


def test_the_jobs_of_each_framework():
    b = e2e.Budget(2, 6554, 4, 0.5)
    ours = e2e.job(e2e.Variant("ringweave", "ddp", "int8+ef"), b, "m.csv", 4)
    assert ours[:2] == ["-m", "trainer"] and ours[ours.index("--compression") + 1] == "int8+ef"
    assert "--compression-warmup-steps" not in ours
    plain = e2e.job(e2e.Variant("torch", "ddp", "none"), b, "m.csv", 4)
    psgd = e2e.job(e2e.Variant("torch", "ddp", "powersgd"), b, "m.csv", 4)
    assert plain[1] == psgd[1] == "--torch-worker" and Path(plain[0]).name == "compress_e2e.py"
    assert plain[plain.index("--powersgd-rank") + 1] == "0" and psgd[psgd.index("--powersgd-rank") + 1] == "4"
    assert psgd[psgd.index("--powersgd-start") + 1] == "52"
    assert "--compression" not in psgd  # the trainer's arguments after --trainer: data, model and schedule only
    assert psgd[psgd.index("--trainer") + 1:] == e2e.trainer_args(e2e.Variant("torch", "ddp", "powersgd"), b, "m.csv")


def test_the_variants_run_what_the_trainer_takes_and_name_its_refusals():
    run, refused = e2e.variants(["ddp", "fsdp"], list(e2e.CODECS), torch=True)
    assert [v.label for v in run] == ["ddp none", "ddp int8+ef", "ddp topk+ef", "ddp powersgd+ef", "fsdp none",
                                      "fsdp int8+ef", "fsdp topk+ef", "torch-ddp", "torch-ddp powersgd"]
    # ddp reduces each bucket's matrices with powersgd; fsdp reduce-scatters blocks, which it cannot
    assert {v.label for v in refused} == {"fsdp powersgd+ef"}
    assert "compresses whole matrices" in refused[e2e.Variant("ringweave", "fsdp", "powersgd+ef")]
    run, refused = e2e.variants(["fsdp"], ["none", "int8+ef"], torch=False)
    assert [v.label for v in run] == ["fsdp none", "fsdp int8+ef"] and not refused


# ---- torch's anchor is the trainer's model ------------------------------------------------------


def test_torch_starts_from_the_trainers_parameters_and_computes_its_loss():
    torch = pytest.importorskip("torch")
    from trainer.cli import parse_args
    targs = parse_args(["--model", "gpt", "--n-layer", "2", "--windows-per-epoch", "64", "--epochs", "4",
                        "--warmup-steps", "2"])
    data, config, schedule, module, loss_fn = e2e.torch_setup(targs)
    from trainer.cli import build_model
    ours = build_model(targs, data)
    params = ours.init_params(config.seed)
    x, y = data.train.get(np.arange(4), 0)
    want = ours.metrics(params, x, y)["loss"] / len(x)  # the sum over windows of each one's mean
    with torch.no_grad():
        got = float(loss_fn(module(torch.from_numpy(x)), torch.from_numpy(y)))
    assert got == pytest.approx(want, rel=1e-5)
    opt = e2e.torch_optimizer(module, config)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == config.weight_decay and opt.param_groups[1]["weight_decay"] == 0
    assert len(decayed) == 4 * 2 and id(module.wte.weight) not in decayed  # 4 matrices a block, no embedding
    assert schedule(0) == pytest.approx(config.lr / config.warmup_steps)


def test_a_budget_other_than_two_full_epochs_says_so():
    assert e2e.Budget(2, 6554, 4, 0.5).deviations(6554) == []
    assert e2e.Budget(1, 3200, 4, 0.5).deviations(6554) == ["1 epoch, not the 2 the goal names",
                                                            "epochs of 3,200 windows, not the trainer's 6,554"]


def test_the_warm_up_jobs_are_one_step_of_each_variant_of_the_trainer(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(e2e.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or
                        type("Done", (), {"returncode": 0, "stderr": ""})())
    e2e.warm_caches([e2e.Variant("ringweave", "ddp", "int8+ef"), e2e.Variant("torch", "ddp", "powersgd")],
                    str(tmp_path))
    assert len(ran) == 1 and ran[0][ran[0].index("--compression") + 1] == "int8+ef"
    from trainer.cli import parse_args
    targs = parse_args(ran[0][ran[0].index("trainer") + 1:])
    assert (targs.epochs, targs.windows_per_epoch, targs.batch_size) == (1, 64, 64)


# ---- the knobs, the filters, the estimate ---------------------------------------------------------


def test_the_bucket_size_and_top_k_ratio_reach_the_trainer_and_torch_ddp():
    from trainer.cli import make_config, parse_args
    b = e2e.Budget(2, 6554, 4, 0.5)
    args = parse_args(e2e.trainer_args(e2e.Variant("ringweave", "ddp", "topk+ef"), b, "m.csv", bucket_cap_mb=0.5,
                                       topk_ratio=0.1))
    assert args.bucket_cap_mb == 0.5 and args.compression == "topk+ef:ratio=0.1"
    assert make_config(args, 26).compression == "topk+ef:ratio=0.1" and make_config(args, 26).compression_start == 52
    assert parse_args(e2e.trainer_args(e2e.Variant("ringweave", "ddp", "int8+ef"), b, "m.csv", topk_ratio=0.1)
                      ).compression == "int8+ef"  # the ratio is top-k's alone
    torch_job = e2e.job(e2e.Variant("torch", "ddp", "none"), b, "m.csv", 4, bucket_cap_mb=0.5, topk_ratio=None,
                        flat=True)
    assert parse_args(torch_job[torch_job.index("--trainer") + 1:]).bucket_cap_mb == 0.5  # what its DDP takes
    assert "--bucket-cap-mb" not in e2e.trainer_args(e2e.Variant("ringweave", "ddp", "none"), b, "m.csv")
    psgd = make_config(parse_args(e2e.trainer_args(e2e.Variant("ringweave", "ddp", "powersgd+ef"), b, "m.csv")), 26)
    assert (psgd.compression, psgd.compression_start) == ("powersgd+ef", 52)  # torch's hook starts alike
    ours = e2e.job(e2e.Variant("ringweave", "ddp", "powersgd+ef"), b, "m.csv", 16)
    assert ours[ours.index("--compression") + 1] == "powersgd+ef:rank=16"  # --powersgd-rank: ours as torch's
    assert e2e.parse_args(["--out", "x.md", "--estimate"]).powersgd_rank == 32  # rank 4 ends +6.6%, 32 +0.18%
    flat = parse_args(e2e.trainer_args(e2e.Variant("ringweave", "ddp", "int8+ef"), b, "m.csv", flat=True))
    assert make_config(flat, 26).compression_host_first is False
    host_first = parse_args(e2e.trainer_args(e2e.Variant("ringweave", "ddp", "int8+ef"), b, "m.csv"))
    assert make_config(host_first, 26).compression_host_first is True


def test_the_estimate_is_the_prior_seconds_per_step_scaled_to_the_budget(tmp_path):
    record = tmp_path / "e2e.json"
    record.write_text(json.dumps({"meta": {}, "results": [
        {"rate": "100mbit", "label": "ddp none", "wall_s": 112.0, "steps": 200},
        {"rate": "100mbit", "label": "torch-ddp", "wall_s": 130.0, "steps": 200},
        {"rate": "1gbit", "label": "ddp none", "wall_s": 50.0, "steps": 200},
        {"rate": "1gbit", "label": "torch-ddp", "wall_s": 60.0, "steps": 200},
        {"rate": "1gbit", "label": "fsdp powersgd+ef", "refused": "why"}]}))  # a refused row: no time
    prior = e2e.prior_wall_s_per_step(str(record))
    assert prior == {"100mbit": {"ddp none": 0.56, "torch-ddp": 0.65}, "1gbit": {"ddp none": 0.25, "torch-ddp": 0.3}}
    one = e2e.estimate_s(["100mbit"], ["ddp none"], 208, prior)
    assert one == pytest.approx(e2e.WARM_JOB_S + e2e.PER_JOB_S + 208 * prior["100mbit"]["ddp none"])
    both = e2e.estimate_s(["100mbit", "1gbit"], ["ddp none", "torch-ddp"], 100, prior)
    assert both == pytest.approx(e2e.WARM_JOB_S + 4 * e2e.PER_JOB_S + 100 * (
        prior["100mbit"]["ddp none"] + prior["100mbit"]["torch-ddp"] + prior["1gbit"]["ddp none"]
        + prior["1gbit"]["torch-ddp"]))
    # a variant never measured takes its strategy's none; a rate never measured the nearest one's
    assert e2e.estimate_s(["1gbit"], ["ddp powersgd+ef"], 10, prior) == e2e.estimate_s(["1gbit"], ["ddp none"], 10, prior)
    assert e2e.estimate_s(["200mbit"], ["ddp none"], 10, prior) == e2e.estimate_s(["100mbit"], ["ddp none"], 10, prior)
    assert e2e.prior_wall_s_per_step(str(tmp_path / "missing.json")) == {}
    assert e2e.prior_wall_s_per_step() != {}  # the committed record is read


def test_estimate_runs_nothing_and_filters_the_variants(monkeypatch, capsys):
    monkeypatch.setattr(e2e, "run_grid", lambda *a: pytest.fail("--estimate ran the grid"))
    assert e2e.main(["--out", "x.md", "--estimate", "--rate", "1gbit", "--torch", "off",
                     "--variants", "ddp none,ddp int8+ef"]) == 0
    err = capsys.readouterr().err
    assert "2 variants x 1 rates (1gbit), 208 steps each" in err
    want = e2e.estimate_s(["1gbit"], ["ddp none", "ddp int8+ef"], 208)
    assert f"about {want / 60:.0f} minutes" in err


def test_from_json_takes_several_runs_together(tmp_path):
    meta = {"title": "t", "command": "c1", "machine": "m", "date": "d", "load_before": 1.0, "load_after": 2.0,
            "budget": "b", "torch": None}
    rows = _hand_made()
    other = [dict(r, rate="1gbit") for r in rows]
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta, "results": rows}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": dict(meta, command="c2", load_after=3.0), "results": other}))
    assert e2e.main(["--from-json", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--out",
                     str(tmp_path / "both.md")]) == 0
    text = (tmp_path / "both.md").read_text()
    assert "### 100mbit" in text and "### 1gbit" in text
    assert "- Command: `c1`; `c2`" in text and "load 1.0 before, 3.0 after" in text
    together = json.loads((tmp_path / "compress_e2e.json").read_text())  # beside --out, drawn again alike
    assert len(together["results"]) == 2 * len(rows) and together["meta"]["command"] == "c1`; `c2"


def test_wait_for_load_waits_until_the_load_falls_and_no_longer_than_its_limit():
    loads = iter([3.0, 2.0, 0.9, 0.5])
    slept = []
    assert e2e.wait_for_load(1.0, 60, load=lambda: (next(loads), 0, 0), sleep=slept.append) == 0.9
    assert slept == [2.0, 2.0]
    assert e2e.wait_for_load(1.0, 0.0, load=lambda: (4.0, 0, 0), sleep=slept.append) == 4.0  # limit spent
    assert slept == [2.0, 2.0]
