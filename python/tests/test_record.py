"""The result record: built by gpufit.track, checked by the recorders' Rust
parser, written where gpufit looks (termination log, Slurm result file,
controller API)."""

import http.server
import json
import threading

import pytest

import gpufit
from gpufit import record


def read(path):
    with open(path) as f:
        return json.load(f)


def test_track_records_what_the_loop_ran_and_its_throughput(tmp_path, monkeypatch):
    out = tmp_path / "result.json"
    monkeypatch.setenv("GPUFIT_RESULT_FILE", str(out))
    with gpufit.track(micro_batch_size=8, gradient_accumulation_steps=2, dtype="bfloat16", seq_len=128, num_workers=3) as t:
        for _ in range(5):
            t.step()
    rec = read(out)
    assert t.written == [str(out)] and rec == t.record
    assert rec["schema_version"] == record.SCHEMA_VERSION == 1
    assert rec["source"] == "track" and rec["outcome"] == "completed"
    assert rec["ran"] == {"micro_batch_size": 8, "gradient_accumulation_steps": 2, "dtype": "bf16", "num_workers": 3}
    assert rec["steps"] == 5 and rec["world_size"] == 1
    # 5 steps × 8 × 2 samples × 128 tokens over the measured time.
    assert rec["tokens_per_sec"] * rec["duration_sec"] == pytest.approx(5 * 16 * 128)
    assert rec["samples_per_sec"] * rec["duration_sec"] == pytest.approx(5 * 16)
    assert "injected" not in rec
    assert rec["peaks"] == []  # no CUDA here


def test_a_run_that_ignores_the_injected_batch_is_recorded_with_what_it_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFIT_MICRO_BATCH_SIZE", "4")
    monkeypatch.setenv("GPUFIT_DTYPE", "bf16")
    monkeypatch.setenv("GPUFIT_JOB_ID", "42")
    term = tmp_path / "termination-log"
    with gpufit.track(micro_batch_size=8, dtype="bf16", termination_log=str(term)) as t:
        t.step(samples=8, tokens=8 * 64)
    rec = read(term)
    assert rec["injected"] == {"micro_batch_size": 4, "dtype": "bf16"}
    assert rec["ran"]["micro_batch_size"] == 8
    assert rec["job_id"] == "42"
    assert record.mismatches(rec) == [["micro_batch_size", "4", "8"]]
    assert len(term.read_bytes()) <= record.MAX_RECORD_BYTES


def test_oom_and_failure_are_recorded_and_the_exception_propagates(tmp_path):
    class OutOfMemoryError(RuntimeError):
        pass

    out = tmp_path / "r.json"
    with pytest.raises(OutOfMemoryError):
        with gpufit.track(micro_batch_size=2, result_file=str(out)):
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert read(out)["outcome"] == "oom"
    with pytest.raises(KeyError):
        with gpufit.track(micro_batch_size=2, result_file=str(out)):
            raise KeyError("x")
    assert read(out)["outcome"] == "failed"


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "r.json"
    with gpufit.track(micro_batch_size=2, seq_len=10, result_file=str(out)) as t:
        t.step()
    assert not out.exists() and t.written == []
    assert t.record["world_size"] == 2
    # Without torch.distributed each rank's rate stands for every rank's.
    assert t.record["tokens_per_sec"] * t.record["duration_sec"] == pytest.approx(2 * 2 * 10)


def test_bad_injected_values_and_bad_settings_are_refused(monkeypatch):
    monkeypatch.setenv("GPUFIT_MICRO_BATCH_SIZE", "four")
    with pytest.raises(gpufit.GpufitError, match="GPUFIT_MICRO_BATCH_SIZE=four"):
        record.injected_settings()
    with pytest.raises(ValueError):
        gpufit.track(micro_batch_size=0)


def test_the_recorders_parser_is_strict():
    good = {"schema_version": 1, "source": "track", "world_size": 1, "ran": {"micro_batch_size": 2}, "steps": 1, "outcome": "completed"}
    assert record.validate(good)["ran"] == {"micro_batch_size": 2}
    for bad, why in [
        ({**good, "extra": 1}, "unknown field"),
        ({**good, "schema_version": 2}, "upgrade gpufit"),
        ({**good, "ran": {"micro_batch_size": 0}}, "is 0"),
        ({**good, "peaks": [{"rank": 3, "allocated_bytes": 1, "reserved_bytes": 2}]}, "outside world_size"),
        ({**good, "tokens_per_sec": -1.0}, "non-negative"),
        ({**good, "device": "x" * 5000}, "4096"),
    ]:
        with pytest.raises(gpufit.GpufitError, match=why):
            record.validate(bad)


def test_many_ranks_keep_the_record_within_the_termination_message_limit(tmp_path):
    peaks = [{"rank": r, "allocated_bytes": 10**9 + r, "reserved_bytes": 2 * 10**9 + r} for r in range(256)]
    rec = {"schema_version": 1, "source": "hf", "world_size": 256, "ran": {"micro_batch_size": 2}, "peaks": peaks, "steps": 1, "outcome": "completed"}
    out = tmp_path / "t"
    assert record.write(rec, termination_log=str(out)) == [str(out)]
    kept = read(out)
    assert kept["peaks"] == [peaks[-1]]  # the largest reserved peak survives


def test_the_record_is_posted_to_the_controller_with_the_token(tmp_path, monkeypatch):
    got = {}

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got["auth"] = self.headers.get("Authorization")
            got["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.handle_request, daemon=True)
    th.start()
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    monkeypatch.setenv("GPUFIT_TOKEN_FILE", str(tok))
    url = f"http://127.0.0.1:{srv.server_port}/v1/results"
    with gpufit.track(micro_batch_size=4, controller_url=url) as t:
        t.step()
    th.join(10)
    srv.server_close()
    assert t.written == [url]
    assert got["auth"] == "Bearer s3cret"
    assert got["body"]["ran"]["micro_batch_size"] == 4


def test_an_unwritable_destination_does_not_fail_training(tmp_path):
    with gpufit.track(micro_batch_size=2, result_file=str(tmp_path / "no" / "such" / "dir" / "r.json")) as t:
        t.step()
    assert t.written == [] and t.record["outcome"] == "completed"
