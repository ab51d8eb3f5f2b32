"""trainer/runid.py without files: the job's identity from each launcher's variables, the run's
config and its contract, and every decision of the table (one test per transition)."""

import re

import pytest

from trainer.nn import GPT, GPTConfig, mlp
from trainer.runid import (Action, JobIdentity, Resume, RunError, RunFound, check_run, choose_run, decide,
                           differences, job_identity, legacy_config, param_shapes, run_config, run_of, to_load)

HEX32 = re.compile(r"^[0-9a-f]{32}$")
A, B, OWN = "a" * 32, "b" * 32, "c" * 32
BATCHING = {"n_train": 100, "global_batch_size": 16, "grad_accum": 1, "seed": 0}
CONFIG = {"model": "gpt", "n_layer": 2, "n_head": 4, "params": "p1", "optimizer": "adamw", **BATCHING}
FIRST = JobIdentity("RINGWEAVE_JOB=job-1", 0)
RESTARTED = JobIdentity("RINGWEAVE_JOB=job-1", 1, ("RINGWEAVE_RESTART=1",))


def run(id, *steps, config=CONFIG, readable=True, created=1.7e9):
    return RunFound(id, tuple(f"step-{s:08d}" for s in steps), steps, created if readable else None,
                    dict(config) if readable else {}, readable=readable)


def decide_(found, *, job=FIRST, resume=Resume.NEVER, move_aside=False, config=CONFIG):
    return decide(found, where="ckpt", own_id=OWN, job=job, resume=resume, move_aside=move_aside, config=config)


# ---- the job's identity --------------------------------------------------------------------------


@pytest.mark.parametrize("env, key, restart", [
    ({}, None, 0),
    ({"RINGWEAVE_JOB": "job-1a2b", "RINGWEAVE_RESTART": "2"}, "RINGWEAVE_JOB=job-1a2b", 2),
    ({"TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "1"}, "TORCHELASTIC_RUN_ID=exp7", 1),
    ({"SLURM_JOB_ID": "5042", "SLURM_RESTART_COUNT": "1"}, "SLURM_JOB_ID=5042", 1),
    # our launcher inside a SLURM job: the SLURM job outlives the launcher's fresh id (a requeue starts a new one)
    ({"SLURM_JOB_ID": "5042", "SLURM_RESTART_COUNT": "1", "RINGWEAVE_JOB": "job-ff", "RINGWEAVE_RESTART": "2"},
     "SLURM_JOB_ID=5042", 3),
    ({"SLURM_JOB_ID": "5042", "SLURM_RESTART_COUNT": "0", "RINGWEAVE_RESTART": "0"}, "SLURM_JOB_ID=5042", 0),
])
def test_the_job_is_named_by_its_outermost_launcher_and_restarts_add_up(env, key, restart):
    job = job_identity(env)
    assert (job.key, job.restart) == (key, restart)
    assert job.counters == tuple(f"{n}={env[n]}" for n in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT",
                                                            "RINGWEAVE_RESTART") if int(env.get(n, "0")))


def test_a_run_id_is_stable_across_the_attempts_of_a_job_and_fresh_without_one():
    first = job_identity({"SLURM_JOB_ID": "5042"}).run_id(lambda: "unused")
    again = job_identity({"SLURM_JOB_ID": "5042", "SLURM_RESTART_COUNT": "3"}).run_id(lambda: "unused")
    other = job_identity({"SLURM_JOB_ID": "5043"}).run_id(lambda: "unused")
    assert first == again != other and HEX32.match(first) and HEX32.match(other)
    assert job_identity({}).run_id(lambda: OWN) == OWN


def test_a_restart_counter_that_is_not_a_count_is_refused():
    with pytest.raises(RunError, match=r"SLURM_RESTART_COUNT='-1' is not a restart count"):
        job_identity({"SLURM_RESTART_COUNT": "-1"})


# ---- the config and the metadata contract ----------------------------------------------------------


def gpt(**kw):
    return GPT(GPTConfig(**{"vocab_size": 256, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8, **kw}))


def test_the_config_holds_the_architecture_and_leaves_out_what_may_change():
    config = run_config(gpt(dropout=0.1, kernel="reference"), optimizer="adamw", batching=BATCHING,
                        fields={"data": "pydoc"})
    check_run({"id": A, "config": config})  # the metadata contract: {name: JSON scalar or list of scalars}
    assert {k: config[k] for k in ("model", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "gelu",
                                   "optimizer", "data")} == \
        {"model": "gpt", "vocab_size": 256, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8, "gelu": "tanh",
         "optimizer": "adamw", "data": "pydoc"}
    assert BATCHING.items() <= config.items() and "dropout" not in config and "kernel" not in config
    same = run_config(gpt(), optimizer="adamw", batching=BATCHING, fields={"data": "pydoc"})
    assert same == config  # dropout and kernels may change on resume
    heads = run_config(gpt(n_head=4), optimizer="adamw", batching=BATCHING)
    assert heads["params"] == config["params"] and heads["n_head"] == 4  # same shapes: only n_head tells


@pytest.mark.parametrize("run", [
    {"id": A.upper(), "config": {}}, {"id": A[:31], "config": {}}, {"id": A}, {"id": A, "config": {}, "x": 1},
    {"id": A, "config": {"n": {"nested": 1}}}, {"id": A, "config": {"n": [[1]]}}, {"id": A, "config": []}, [A],
])
def test_a_run_that_breaks_the_contract_is_refused(run):
    with pytest.raises(ValueError):
        check_run(run)
    with pytest.raises(ValueError):
        run_of({"run": run})


def test_an_unnamed_checkpoint_tells_what_it_can_of_its_config():
    model = mlp(8, (16,), 3)
    units = [{"index": i, "numel": u.numel, "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset}
                                                      for s in u.param_specs]} for i, u in enumerate(model.units)]
    meta = {"units": units, "optimizer": "sgd", "model": None, "extra": {"loop": {"run": BATCHING}}}
    new = run_config(model, optimizer="sgd", batching=BATCHING, fields={"model": "mlp", "hidden": [16]})
    assert run_of(meta) is None and legacy_config(meta).items() <= new.items()
    assert param_shapes(units) == param_shapes(model.units)


def test_differences_name_each_field_and_the_first_parameter_that_differs():
    old = dict(CONFIG, params="p1")
    new = dict(CONFIG, n_layer=1, n_head=8, params="p2", lr_not_compared=1)
    shapes_old, shapes_new = [["0.w", [4, 4]], ["1.w", [4, 4]]], [["0.w", [4, 4]]]
    assert differences(old, new, shapes_old, shapes_new) == \
        ["n_layer: 2 -> 1", "n_head: 4 -> 8", "params: 1.w [4, 4] -> not in this model"]
    assert differences(old, new)[2] == 'params: "p1" -> "p2"'
    assert differences({"model": "gpt"}, CONFIG) == []  # a field the checkpoint lacks is not compared


# ---- the decisions ------------------------------------------------------------------------------------


def test_nothing_there_starts_a_run_with_the_jobs_id():
    d = decide_([])
    assert (d.action, d.run_id, d.message) == (Action.START, OWN, "")


def test_resume_with_nothing_there_refuses():
    d = decide_([], resume=Resume.ALWAYS)
    assert d.action is Action.REFUSE
    assert d.message == "no checkpoint in ckpt; to start fresh drop --resume, or use --resume auto to resume only " \
                        "when there is one"


def test_resume_auto_with_nothing_there_starts():
    assert decide_([], resume=Resume.AUTO).action is Action.START


def test_a_new_run_refuses_the_directory_of_another_run_naming_it_and_the_ways_forward():
    d = decide_([run(A, 10, 20)])
    assert d.action is Action.REFUSE
    assert f"ckpt holds the checkpoints of another run, run {A} (newest step 20, saved 20" in d.message
    assert "2 checkpoint(s)" in d.message and "add --resume" in d.message
    assert "another --checkpoint-dir" in d.message and "--move-aside" in d.message and "\n" not in d.message


@pytest.mark.parametrize("found, named", [
    ([run(None, 5)], "an unnamed run"), ([run(None, 5, readable=False)], "metadata cannot be read")])
def test_a_new_run_refuses_unnamed_and_unreadable_checkpoints_too(found, named):
    d = decide_(found)
    assert d.action is Action.REFUSE and named in d.message


def test_a_brand_new_job_refuses_even_checkpoints_that_carry_its_own_id():
    """A reused job id (--job-id, torchrun's --rdzv-id) with restart count 0 is a new run."""
    assert decide_([run(OWN, 4)]).action is Action.REFUSE


def test_move_aside_moves_every_run_there_and_starts():
    found = [run(A, 4), run(None, 9), run(None, 12, readable=False)]
    d = decide_(found, move_aside=True)
    assert (d.action, d.run_id, d.aside) == (Action.MOVE_ASIDE, OWN, tuple(found))


def test_a_restart_continues_its_own_run_without_resume():
    d = decide_([run(OWN, 4, 8)], job=RESTARTED)
    assert (d.action, d.run_id, d.source.names) == (Action.CONTINUE, OWN, ("step-00000004", "step-00000008"))
    assert d.message == f"restart 1 of the run {OWN}: RINGWEAVE_RESTART=1"


def test_a_restart_continues_its_own_run_even_beside_another():
    d = decide_([run(A, 40), run(OWN, 4)], job=RESTARTED)
    assert (d.action, d.source.id) == (Action.CONTINUE, OWN)


def test_a_restart_never_continues_another_run():
    """A first attempt refused (another run's directory) and restarted by the launcher must refuse again."""
    d = decide_([run(A, 40)], job=RESTARTED)
    assert d.action is Action.REFUSE and d.message.startswith(f"restart 1 of the run {OWN}: ckpt holds the check")


def test_a_restart_before_any_checkpoint_starts_and_says_so():
    d = decide_([], job=RESTARTED)
    assert (d.action, d.run_id) == (Action.START, OWN)
    assert d.message == f"restart 1 of the run {OWN}: no checkpoint of it in ckpt yet, starting from step 0"


def test_a_restart_of_a_run_whose_config_changed_refuses():
    assert decide_([run(OWN, 4)], job=RESTARTED, config=dict(CONFIG, n_layer=3)).action is Action.REFUSE


@pytest.mark.parametrize("resume", [Resume.ALWAYS, Resume.AUTO])
def test_resume_continues_the_directorys_run_under_its_own_id(resume):
    d = decide_([run(A, 4, 8)], resume=resume)
    assert (d.action, d.run_id, d.source.id, d.message) == (Action.CONTINUE, A, A, f"run {A}")


def test_resume_of_an_unnamed_run_continues_it_under_the_jobs_id():
    d = decide_([run(None, 4)], resume=Resume.ALWAYS)
    assert (d.action, d.run_id, d.source.id) == (Action.CONTINUE, OWN, None)


def test_resume_refuses_a_different_config_naming_each_field():
    d = decide_([run(A, 4)], resume=Resume.ALWAYS, config=dict(CONFIG, n_layer=1, n_head=8))
    assert d.action is Action.REFUSE
    assert d.message.startswith(f"cannot continue run {A} in ckpt: 2 setting(s) differ from its checkpoints "
                                f"(checkpoint -> now): n_layer: 2 -> 1; n_head: 4 -> 8; ")


def test_resume_takes_the_named_run_over_unnamed_checkpoints_whatever_their_steps():
    found = [run(None, 90), run(A, 4, 8), run(None, 99, readable=False)]
    d = decide_(found, resume=Resume.ALWAYS)
    assert (d.action, d.source.id) == (Action.CONTINUE, A)
    # its own, and those that cannot be read (they fail to load and are named); never the unnamed run's
    assert to_load(d.source, found) == ["step-00000004", "step-00000008", "step-00000099"]


def test_resume_refuses_several_named_runs():
    d = decide_([run(A, 4), run(B, 8)], resume=Resume.AUTO)
    assert d.action is Action.REFUSE and "holds the checkpoints of 2 runs" in d.message
    assert A in d.message and B in d.message
    with pytest.raises(RunError, match="2 runs"):
        choose_run([run(A, 4), run(B, 8)], "ckpt")


def test_resume_with_only_unreadable_checkpoints_tries_them_so_the_loader_says_why():
    found = [run(None, 4, readable=False)]
    d = decide_(found, resume=Resume.ALWAYS)
    assert (d.action, d.source, to_load(d.source, found)) == (Action.CONTINUE, None, ["step-00000004"])


def test_a_checkpoint_whose_run_is_damaged_is_never_offered_to_the_loader():
    """Loading does not read "run", so such a checkpoint (another run's, perhaps) could load in place of ours."""
    damaged = RunFound(None, ("step-00000009",), (9,), readable=False, tried=False)
    d = decide_([damaged, run(A, 4)], resume=Resume.ALWAYS)
    assert (d.action, to_load(d.source, [damaged, run(A, 4)])) == (Action.CONTINUE, ["step-00000004"])
    d = decide_([damaged], resume=Resume.AUTO)
    assert d.action is Action.REFUSE and 'ckpt holds no checkpoint that can be continued: checkpoints with a ' \
                                          'damaged "run" (newest step 9' in d.message
    assert decide_([damaged]).action is Action.REFUSE  # and a new run does not start beside it


def test_resume_modes_from_fit_arguments():
    assert [Resume.of(v) for v in (None, False, True, "always", "auto", Resume.AUTO)] == \
        [Resume.NEVER, Resume.NEVER, Resume.ALWAYS, Resume.ALWAYS, Resume.AUTO, Resume.AUTO]
    with pytest.raises(ValueError):
        Resume.of("sometimes")
