"""`python -m trainer` argument parsing and the TrainConfig it makes (no processes)."""

import numpy as np
import pytest

from trainer.cli import build_parser, load_data, make_config, parse_args

pytestmark = pytest.mark.timeout(30)


def test_defaults():
    args = parse_args([])
    assert (args.strategy, args.epochs, args.batch_size, args.lr, args.optimizer) == ("ddp", 5, 64, 2e-3, "adamw")
    assert (args.data, args.width, args.depth, args.grad_accum) == ("digits", 256, 2, 1)
    assert args.checkpoint_dir is None and not args.resume and args.clip_norm is None
    config = make_config(args, steps_per_epoch=23)
    assert config.total_steps == 115 and config.warmup_steps == 11
    assert config.strategy == "ddp" and config.loss_scale is None and config.compression is None
    assert config.reshard_after_forward and config.prefetch


def test_every_flag_reaches_the_config():
    args = parse_args([
        "--strategy", "fsdp", "--epochs", "3", "--batch-size", "128", "--lr", "0.01", "--optimizer", "sgd",
        "--momentum", "0.8", "--weight-decay", "0", "--param-dtype", "bfloat16", "--reduce-dtype", "float16",
        "--grad-accum", "4", "--clip-norm", "1.5", "--compression", "int8", "--seed", "7",
        "--no-reshard-after-forward", "--no-prefetch", "--loss-scale", "on", "--check-every", "10",
        "--warmup-steps", "5", "--bucket-cap-mb", "2", "--master-dtype", "float64",
    ])
    c = make_config(args, steps_per_epoch=10)
    assert (c.strategy, c.optimizer, c.lr, c.momentum, c.weight_decay) == ("fsdp", "sgd", 0.01, 0.8, 0.0)
    assert (c.param_dtype, c.reduce_dtype, c.master_dtype) == ("bfloat16", "float16", "float64")
    assert (c.grad_accum, c.clip_norm, c.compression, c.seed) == (4, 1.5, "int8", 7)
    assert not c.reshard_after_forward and not c.prefetch and c.loss_scale is True
    assert (c.check_every, c.warmup_steps, c.total_steps, c.bucket_cap_mb) == (10, 5, 30, 2.0)
    assert make_config(parse_args(["--compression", "none"]), 5).compression is None
    assert make_config(parse_args(["--loss-scale", "off"]), 5).loss_scale is False
    assert make_config(parse_args(["--betas", "0.9,0.95"]), 5).betas == (0.9, 0.95)
    assert parse_args(["--metrics", "runs/m.jsonl"]).metrics == "runs/m.jsonl"
    assert parse_args(["--checkpoint-dir", "c", "--save-best", "val_acc"]).save_best == "val_acc"


def test_warmup_never_exceeds_the_schedule():
    c = make_config(parse_args(["--epochs", "1", "--warmup-steps", "50"]), steps_per_epoch=10)
    assert c.warmup_steps == 10 and c.total_steps == 10
    assert make_config(parse_args(["--epochs", "0"]), steps_per_epoch=10).total_steps == 1


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "zero4"], "invalid choice"),
    (["--epochs", "-1"], "must be >= 0"),
    (["--batch-size", "0"], "must be >= 1"),
    (["--lr", "0"], "must be > 0"),
    (["--grad-accum", "0"], "must be >= 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--param-dtype", "int8"], "invalid choice"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--dropout", "1"], "--dropout"),
    (["--checkpoint-dir", "c", "--resume", "sometimes"], "takes no value (resume, and refuse if there is no"),
    (["--move-aside"], "--move-aside needs --checkpoint-dir"),
    (["--checkpoint-dir", "c", "--resume", "--move-aside"], "--move-aside starts a new run and --resume"),
    (["--pp", "4"], "--pp 4 stages need a block each; the mlp has 3 (--depth + 1): choose --pp <= 3"),
    (["--model", "gpt", "--n-layer", "2", "--pp", "3"], "the gpt has 2 (--n-layer): choose --pp <= 2"),
    (["--pp", "2", "--stage-layers", "1,1"], "--stage-layers 1,1 adds up to 2 blocks; the mlp has 3"),
    (["--replicas", "2"], "HSDP needs --strategy zero1, zero2, zero3 or fsdp"),  # the default is ddp
    (["--strategy", "ddp", "--replicas"], "HSDP needs --strategy"),
    (["--strategy", "fsdp", "--replicas", "0"], "'0' must be a replica count >= 1, or hosts"),
    (["--strategy", "fsdp", "--replicas", "host"], "'host' must be a replica count >= 1, or hosts"),
    (["--model", "gpt", "--strategy", "fsdp", "--dp", "4", "--replicas", "3"], "--replicas 3 must divide --dp 4"),
])
def test_bad_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_replicas_and_the_models_the_mesh_splits(monkeypatch):
    assert parse_args([]).replicas == 1
    assert parse_args(["--strategy", "zero2", "--replicas", "2"]).replicas == 2
    assert parse_args(["--strategy", "fsdp", "--replicas"]).replicas == "hosts"  # one replica per host
    assert parse_args(["--strategy", "fsdp", "--replicas", "hosts", "--epochs", "1"]).replicas == "hosts"
    assert parse_args(["--model", "gpt", "--strategy", "fsdp", "--dp", "4", "--replicas", "2"]).dp == 4
    assert parse_args(["--replicas", "1"]).strategy == "ddp"  # one replica: plain data parallelism
    from trainer import cli

    assert cli.split_refusal(parse_args(["--model", "gpt", "--tp", "2"])) is None
    mlp_tp = parse_args(["--tp", "2", "--pp", "3"])
    assert cli.split_refusal(mlp_tp) is None  # the MLP splits too
    monkeypatch.setattr(cli, "SPLIT_MODELS", ("gpt",))  # a model the mesh does not split: refused in one line
    assert cli.split_refusal(mlp_tp) == ("--tp, --pp, --dp, --micro-batches and --stage-layers split --model gpt, "
                                         "not mlp")


def test_resume_modes():
    assert parse_args(["--checkpoint-dir", "c"]).resume is None
    assert parse_args(["--checkpoint-dir", "c", "--resume"]).resume == "always"
    assert parse_args(["--checkpoint-dir", "c", "--resume", "auto"]).resume == "auto"
    assert parse_args(["--checkpoint-dir", "c", "--resume=auto", "--epochs", "2"]).resume == "auto"
    assert parse_args(["--checkpoint-dir", "c", "--move-aside"]).move_aside


def test_help_lists_the_flags():
    text = build_parser().format_help()
    for flag in ("--strategy", "--epochs", "--batch-size", "--lr", "--optimizer", "--param-dtype",
                 "--reduce-dtype", "--grad-accum", "--clip-norm", "--compression", "--checkpoint-dir",
                 "--resume", "--seed", "--data", "--size", "--width", "--depth", "--replicas"):
        assert flag in text


def test_data_choices():
    digits = load_data(parse_args([]))
    assert digits.x_train.shape == (1438, 64) and digits.x_val.shape == (359, 64)
    syn = load_data(parse_args(["--data", "synthetic", "--size", "1000", "--in-dim", "12", "--classes", "4"]))
    assert syn.x_train.shape == (800, 12) and syn.x_val.shape == (200, 12) and syn.num_classes == 4
    assert syn.x_train.dtype == np.float32
    assert load_data(parse_args(["--data", "synthetic", "--size", "100", "--master-dtype", "float64"])).x_val.dtype \
        == np.float64


def test_blas_threads_default_to_one_per_rank(monkeypatch):
    from trainer.cli import _blas_threads

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert _blas_threads(parse_args([])) == 1
    assert _blas_threads(parse_args(["--blas-threads", "2"])) == 2


@pytest.mark.parametrize("argv, message", [
    (["--betas", "0.9"], "argument --betas: must be two numbers B1,B2, each in [0, 1), e.g. 0.9,0.95; got '0.9'"),
    (["--betas", "1,0.9"], "must be two numbers B1,B2, each in [0, 1)"),
    (["--betas", "nan,0.9"], "must be two numbers B1,B2, each in [0, 1)"),
    (["--save-best", "val_loss"], "--save-best needs --checkpoint-dir"),
    (["--checkpoint-dir", "c", "--save-best", "loss"], "argument --save-best: invalid choice: 'loss'"),
    (["--metrics", "m.txt"], "argument --metrics: metrics file 'm.txt' must end in .csv, .jsonl or .ndjson"),
])
def test_bad_betas_metrics_and_save_best_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
