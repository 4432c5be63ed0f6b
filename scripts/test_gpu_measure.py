#!/usr/bin/env python3
"""scripts/gpu_measure.py's grid files, without a GPU (no torch needed):
the points it reads from a grid CSV are the rows the replay replayed, and
the rows it wrote back on a GPU (bench/data/h200/) are those points.

Run: python3 scripts/test_gpu_measure.py
"""

import csv
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_measure  # noqa: E402

DATA = os.path.join(HERE, "..", "bench", "data")


class PointsFromCsv(unittest.TestCase):
    def test_synthetic_grid_reads_every_row(self):
        path = os.path.join(DATA, "synthetic", "grid.csv")
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        pts = gpu_measure.points_from_csv(path)
        self.assertEqual(len(pts), len(rows))
        for r, p in zip(rows, pts):
            self.assertEqual(p["model"], r["model"])
            self.assertEqual(p["method"], r["method"])
            self.assertEqual(p["dtype"], r["dtype"])
            self.assertEqual(p["micro_batch"], int(r["micro_batch"]))
            self.assertEqual(p["seq_len"], int(r["seq_len"]))
            self.assertEqual(p["checkpointing"], r["checkpointing"])
            self.assertEqual(p["attention"], r["attention"])

    def test_measured_rows_are_the_grid_in_order(self):
        # bench/data/h200/grid.csv was measured from the synthetic grid:
        # line n there is line n here (the accuracy bench relies on it)
        grid = gpu_measure.points_from_csv(os.path.join(DATA, "synthetic", "grid.csv"))
        with open(os.path.join(DATA, "h200", "grid.csv"), newline="") as f:
            measured = list(csv.DictReader(f))
        self.assertEqual(len(measured), len(grid))
        for p, m in zip(grid, measured):
            key = ("model", "method", "dtype", "micro_batch", "seq_len", "checkpointing",
                   "attention")
            self.assertEqual([str(p[k]) for k in key], [m[k] for k in key])
            self.assertEqual(m["status"], "ok")

    def refused_at(self, rows, line):
        """A grid file of `rows` (after a header) is refused, naming `line`."""
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write("model,method,dtype,micro_batch,seq_len\n" + "".join(r + "\n" for r in rows))
        try:
            with self.assertRaises(SystemExit) as e:
                gpu_measure.points_from_csv(f.name)
            self.assertIn(f":{line}:", str(e.exception))
        finally:
            os.unlink(f.name)

    def test_unknown_model_is_refused_with_its_line(self):
        self.refused_at(["Qwen/Qwen2.5-0.5B,full,bf16,1,512", "nobody/unknown,full,bf16,1,512"], 3)

    def test_bad_number_is_refused_with_its_line(self):
        self.refused_at(["Qwen/Qwen2.5-0.5B,full,bf16,auto,512"], 2)

    def test_qlora_grid_runs_smallest_first(self):
        pts = gpu_measure.grid("qlora")
        self.assertEqual(pts[0]["optimizer"], "adamw8bit")
        self.assertTrue(all(p["method"] in ("qlora", "lora") for p in pts[1:]))


class TrainerStepClock(unittest.TestCase):
    """The Trainer's tokens/s time steps 2..N, like the manual loop's."""

    def run_clock(self, times, steps):
        ticks = iter(times)
        synced = []
        clock = gpu_measure.StepClock(lambda: synced.append(1), lambda: next(ticks))
        for step in range(1, steps + 1):
            clock.step_ended(step)
        self.assertEqual(len(synced), steps)  # every reading waits for the GPU
        return clock

    def test_first_step_and_setup_are_left_out(self):
        # a slow first step (12 s) then 0.25 s a step: 0.25, not (12+0.75)/4
        clock = self.run_clock([12.0, 12.25, 12.5, 12.75], 4)
        self.assertAlmostEqual(clock.seconds_per_step(), 0.25)
        self.assertEqual((clock.first, clock.last), (1, 4))

    def test_one_step_is_refused(self):
        clock = self.run_clock([3.0], 1)
        with self.assertRaises(ValueError):
            clock.seconds_per_step()


if __name__ == "__main__":
    unittest.main()
