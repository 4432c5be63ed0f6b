#!/usr/bin/env python3
"""scripts/gpu_loop.py's suggest -> record wiring, without a GPU: the real
gpufit binary suggests and records, a stand-in replaces the training run.
It checks that what the loop records is what gpufit suggested, that a
recorded run changes the next suggestion, and that an OOM is recorded as
one (the next round does not repeat the settings that ran out of memory).

Run: python3 scripts/test_gpu_loop.py [PATH_TO_GPUFIT]  (default $CARGO_TARGET_DIR/debug/gpufit, else target/debug/gpufit)
"""

import contextlib
import csv
import io
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_loop  # noqa: E402

# Cargo builds into $CARGO_TARGET_DIR when it is set (relative to the
# current directory, as cargo reads it), else into the repository's target/.
TARGET_DIR = os.environ.get("CARGO_TARGET_DIR") or os.path.join(HERE, "..", "target")
GPUFIT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                         os.path.join(TARGET_DIR, "debug", "gpufit"))
H100 = "NVIDIA H100 80GB HBM3"


def run_loop(tmp, fake, rounds=2, workloads="0", gpu=H100):
    out = os.path.join(tmp, "loop.csv")
    with contextlib.redirect_stdout(io.StringIO()):
        rc = gpu_loop.main(["--gpufit", GPUFIT, "--gpu", gpu, "--rounds", str(rounds),
                            "--workloads", workloads, "--history", os.path.join(tmp, "h.db"),
                            "--out", out], train_fn=fake)
    with open(out, newline="") as f:
        return rc, list(csv.DictReader(f))


class Loop(unittest.TestCase):
    def test_a_measured_run_feeds_the_next_suggestion(self):
        seen = []

        def fake(w, s, steps):
            seen.append(dict(s))
            # a run that used 80 % of the predicted peak, at 90 % of the speed
            return dict(status="ok", peak=0.8 * s["predicted_peak_bytes"],
                        allocated=0.7 * s["predicted_peak_bytes"],
                        tokens_per_sec=0.9 * s["predicted_tokens_per_sec"], duration=60.0)

        with tempfile.TemporaryDirectory() as tmp:
            rc, rows = run_loop(tmp, fake)
        self.assertEqual(rc, 0)
        self.assertEqual(len(rows), 2)
        self.assertTrue(all(r["recorded"] == "True" for r in rows), rows)
        first, second = rows
        self.assertEqual(first["source"], "heuristic")
        self.assertNotEqual(second["source"], "heuristic")
        self.assertGreater(float(second["confidence"]), float(first["confidence"]))
        # the rows are what was suggested and what the run measured
        self.assertEqual(int(first["micro_batch"]), seen[0]["micro_batch_size"])
        self.assertEqual(int(first["measured_peak_bytes"]),
                         int(0.8 * seen[0]["predicted_peak_bytes"]))
        self.assertEqual(first["status"], "ok")

    def test_an_oom_is_recorded_and_not_repeated(self):
        def fake(w, s, steps):
            if not fake.done:
                fake.done = True
                return dict(status="oom", error="CUDA out of memory")
            return dict(status="ok", peak=0.9 * s["predicted_peak_bytes"],
                        tokens_per_sec=s["predicted_tokens_per_sec"], duration=30.0)
        fake.done = False

        with tempfile.TemporaryDirectory() as tmp:
            rc, rows = run_loop(tmp, fake)
        self.assertEqual(rc, 0)
        self.assertEqual([r["status"] for r in rows], ["oom", "ok"])
        self.assertTrue(all(r["recorded"] == "True" for r in rows), rows)
        settings = [(r["micro_batch"], r["dtype"], r["checkpointing"], r["compile"])
                    for r in rows]
        self.assertNotEqual(settings[0], settings[1])
        self.assertLess(int(rows[1]["predicted_peak_bytes"]),
                        int(rows[0]["predicted_peak_bytes"]))

    def test_a_suggestion_gpufit_refuses_runs_nothing(self):
        def fake(w, s, steps):
            raise AssertionError("trained without a suggestion")

        with tempfile.TemporaryDirectory() as tmp:
            rc, rows = run_loop(tmp, fake, gpu="NVIDIA Imaginary 1GB")
        self.assertEqual(rc, 0)
        self.assertEqual(rows, [])

    def test_every_workload_names_a_model_the_measuring_script_builds(self):
        import gpu_measure
        for w in gpu_loop.WORKLOADS:
            self.assertIn(w["model"], gpu_measure.MODELS)
            self.assertIn(gpu_measure.MODELS[w["model"]]["model_type"],
                          gpu_measure.LORA_TARGETS)

    def test_a_dtype_the_step_cannot_run_is_an_error_not_a_guess(self):
        res = gpu_loop.train(gpu_loop.WORKLOADS[0], dict(dtype="fp8"), 3)
        self.assertEqual(res["status"], "error")
        self.assertIn("fp8", res["error"])


if __name__ == "__main__":
    if not os.access(GPUFIT, os.X_OK):
        sys.exit(f"{GPUFIT} is not an executable gpufit (cargo build first)")
    unittest.main(argv=sys.argv[:1])
