"""The `serve_eval` stage with real processes: the built-in server on the tiny project of tests/serve
(serve_helpers.tiny_project: tiny Llama target, its exported Domino draft), a few prompts of a few tokens.

- success: serve_eval.json written, the server's whole process group gone, no child left, log removed;
- failures: a bad prompt file, a server SIGKILLed mid-run, a server that cannot start, one not healthy
  in time: each a UserError naming the problem, the server reaped all the same;
- Ctrl-C and a SIGTERM of the stage stop the server too;
- `Server.stop` escalates to SIGKILL for a group that ignores SIGTERM, grandchildren included.
Run: python -m pytest tests/eval/test_serve_stage.py -q
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from dominospec.cli import main
from dominospec.config import load_params
from dominospec.errors import UserError
from dominospec.eval import served
from dominospec.eval.serve_stage import Server, check_params, group_members, serve_eval

REPO = Path(__file__).resolve().parents[2]
from serve_helpers import tiny_project  # noqa: E402

PROMPTS = ["t5 t6 t7", "t20 t21", "t30 t31 t32"]
STARTED = re.compile(r"serve_eval: started the server \(pid (\d+), log (\S+)\)")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The tiny served project, a JSONL suite of three prompts, serve_eval sized to seconds -> params path."""
    root = tmp_path_factory.mktemp("serve_stage")
    params = tiny_project(root, num_threads=1)
    suite = root / "tiny.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    raw = yaml.safe_load(params.read_text())
    raw["evaluate"].update(suites=[str(suite)], server_concurrency=2, temperature=0.0)
    raw["serve_eval"].update(max_prompts=len(PROMPTS), max_new_tokens=8, startup_timeout_s=120, stop_timeout_s=10)
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    return params


def variant(project: Path, tmp_path: Path, **sections) -> Path:
    """The project's params with `sections` ({section: {key: value}}) updated and metrics under tmp_path."""
    raw = yaml.safe_load(project.read_text())
    raw["paths"]["metrics"] = str(tmp_path / "metrics")
    for section, values in sections.items():
        raw[section].update(values)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def children() -> list[int]:
    """Live (not zombie) processes whose parent is this test process."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def assert_reaped(output: str) -> int:
    """The stage's output -> the server's pid, after checking that neither it nor its group is left."""
    started = STARTED.search(output)
    assert started, output
    pid = int(started[1])
    assert group_members(pid) == [] and not Path(f"/proc/{pid}").exists()
    assert sorted(set(children()) - EARLIER_CHILDREN) == []
    return pid


pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="process checks read /proc")
EARLIER_CHILDREN: set = set()  # children alive before the test (another suite's session server): not the stage's


@pytest.fixture(autouse=True)
def earlier_children():
    EARLIER_CHILDREN.clear()
    EARLIER_CHILDREN.update(children())
    yield


def test_the_stage_measures_the_server_and_leaves_no_process(project, tmp_path, capsys):
    params = variant(project, tmp_path)
    assert main(["serve_eval", "--params", str(params)]) == 0, capsys.readouterr().err
    output = capsys.readouterr().out
    assert_reaped(output)
    assert not Path(STARTED.search(output)[2]).exists()  # a clean run leaves no log

    report = json.loads((tmp_path / "metrics" / "serve_eval.json").read_text())
    assert report["backend"] == "builtin" and report["serve_mode"] == "domino" and report["concurrency"] == [1, 2]
    assert report["max_prompts"] == len(PROMPTS) and report["max_new_tokens"] == 8 and report["startup_s"] > 0
    weights = Path(load_params(params).paths.draft) / "model.safetensors"
    from dominospec.files import sha256_file

    assert report["draft_sha256"] == sha256_file(weights)
    for level in report["suites"]["tiny"].values():
        assert level["n_requests"] == len(PROMPTS) and level["errors"] == 0
        assert 0 < level["completion_tokens"] <= len(PROMPTS) * 8
        assert 1.0 <= level["acceptance_length"] <= 4  # the tiny draft's block size


def test_a_bad_prompt_file_is_named_and_the_server_reaped(project, tmp_path, capsys):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"prompt": "t5 t6"}\n{not json\n')
    params = variant(project, tmp_path, evaluate={"suites": [str(bad)]})
    assert main(["serve_eval", "--params", str(params)]) == 2
    captured = capsys.readouterr()
    assert f"error: the served evaluation failed: {bad}:2: not valid JSON" in captured.err
    assert "The server (pid" not in captured.err  # the server was fine: no log shown
    assert_reaped(captured.out)
    assert not (tmp_path / "metrics" / "serve_eval.json").exists()


def test_a_server_killed_mid_run_is_named_and_reaped(project, tmp_path, capsys, monkeypatch):
    real_run_level = served.run_level

    def kill_the_server_first(*args, **kwargs):
        (server,) = sorted(set(children()) - EARLIER_CHILDREN)
        os.kill(server, signal.SIGKILL)
        while Path(f"/proc/{server}/stat").read_text().split(") ")[1][0] != "Z":  # dead, not yet reaped
            time.sleep(0.01)
        return real_run_level(*args, **kwargs)

    monkeypatch.setattr(served, "run_level", kill_the_server_first)
    with pytest.raises(UserError) as failed:
        serve_eval(load_params(variant(project, tmp_path)))
    message = str(failed.value)
    # unreachable, or the connection kept alive reset, as the requests happen to meet the dead server
    assert re.match(r"the served evaluation failed: (cannot reach the server|http://\S+: \w+Error)", message), message
    assert "\nThe server (pid" in message and "exited with signal SIGKILL; its log" in message
    assert_reaped(capsys.readouterr().out)
    Path(re.search(r"its log (\S+) ends", message)[1]).unlink()  # kept for the user: the server failed


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_stage_stops_the_server(project, tmp_path, capsys, monkeypatch, how):
    def interrupted(*args, **kwargs):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # the stage turns it into KeyboardInterrupt while the server runs
        time.sleep(30)
        raise AssertionError("SIGTERM did not interrupt the stage")

    monkeypatch.setattr(served, "run_level", interrupted)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        serve_eval(load_params(variant(project, tmp_path)))
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    assert_reaped(capsys.readouterr().out)


def test_a_server_that_cannot_start_shows_its_log(project, tmp_path, capsys):
    params = variant(project, tmp_path, serve={"max_queue": 0})  # the server's own check refuses it
    with pytest.raises(UserError) as failed:
        serve_eval(load_params(params))
    message = str(failed.value)
    assert message.startswith("the server did not start\nThe server (pid") and "exited with code 2" in message
    assert "error: serve.max_queue must be >= 1, got 0" in message  # the log's tail
    assert_reaped(capsys.readouterr().out)
    Path(re.search(r"its log (\S+) ends", message)[1]).unlink()


def test_a_server_not_healthy_in_time_is_stopped(project, tmp_path, capsys):
    params = variant(project, tmp_path, serve_eval={"startup_timeout_s": 0.5})
    with pytest.raises(UserError, match=r"did not answer GET http://127\.0\.0\.1:\d+/health with 200 within 0\.5 s "
                                        r"\(serve_eval\.startup_timeout_s\)\nThe server \(pid \d+\) was still running"):
        serve_eval(load_params(params))
    output = capsys.readouterr().out
    assert_reaped(output)
    Path(STARTED.search(output)[2]).unlink()


def test_stop_kills_a_group_that_ignores_sigterm(capsys):
    # A leader and a grandchild, both ignoring SIGTERM (SIG_IGN is inherited), in the server's process group.
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print('ready', flush=True); time.sleep(600)")
    server = Server([sys.executable, "-c", script], "http://127.0.0.1:9", "UNSET_KEY_ENV")
    while "ready" not in server.log.read_text():
        time.sleep(0.05)
    group = server.proc.pid
    assert len(group_members(group)) == 2
    start = time.monotonic()
    server.stop(grace_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5
    assert group_members(group) == [] and server.proc.returncode == -signal.SIGKILL
    assert "ignored SIGTERM for 0.5 s: SIGKILL" in capsys.readouterr().out
    assert sorted(set(children()) - EARLIER_CHILDREN) == [] and not server.log.exists()


def test_params_are_range_checked():
    cfg = load_params(REPO / "params.yaml").serve_eval
    check_params(cfg)
    import dataclasses

    for key, value in [("max_prompts", 0), ("max_new_tokens", -1), ("startup_timeout_s", 0.0),
                       ("stop_timeout_s", float("nan"))]:
        with pytest.raises(UserError, match=rf"serve_eval\.{key} must be .*, got {value}"):
            check_params(dataclasses.replace(cfg, **{key: value}))
