#!/usr/bin/env python3
"""The caching-allocator model of scripts/alloc_sim.py against the rules of
c10/cuda/CUDACachingAllocator.cpp it restates (no torch needed).

Run: python3 scripts/test_alloc_sim.py
"""

import contextlib
import io
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_sim import MB, Allocator, ExpandableAllocator, OutOfMemory, simulate  # noqa: E402

GB = 1024 * MB


class AllocatorRules(unittest.TestCase):
    def test_sizes_round_to_512_bytes(self):
        self.assertEqual(Allocator.round_size(1), 512)
        self.assertEqual(Allocator.round_size(512), 512)
        self.assertEqual(Allocator.round_size(513), 1024)

    def test_segment_sizes_by_request(self):
        self.assertEqual(Allocator.segment_size(4096), 2 * MB)           # small pool
        self.assertEqual(Allocator.segment_size(1 * MB), 2 * MB)         # still small
        self.assertEqual(Allocator.segment_size(1 * MB + 512), 20 * MB)  # under 10 MiB
        self.assertEqual(Allocator.segment_size(10 * MB), 10 * MB)       # own segment
        self.assertEqual(Allocator.segment_size(11 * MB), 12 * MB)       # rounded to 2 MiB

    def test_small_requests_share_a_two_mib_segment(self):
        a = Allocator()
        for _ in range(4):
            a.malloc(512 * 1024)
        self.assertEqual(a.reserved, 2 * MB)      # 4 x 0.5 MiB fill one segment
        a.malloc(512)
        self.assertEqual(a.reserved, 4 * MB)      # the fifth request maps another
        self.assertEqual(a.allocated, 2 * MB + 512)

    def test_large_split_only_when_more_than_one_mib_is_left(self):
        a = Allocator()
        x = a.malloc(9 * MB)        # 20 MiB segment, 11 MiB left: split
        y = a.malloc(10 * MB)       # best fit: the 11 MiB rest; 1 MiB left: not split
        self.assertEqual(a.reserved, 20 * MB)
        self.assertEqual(a.blocks[y][0], 11 * MB)  # the whole rest is taken
        self.assertEqual(a.allocated, 20 * MB)
        a.release(x)
        a.release(y)
        self.assertEqual(a.allocated, 0)
        self.assertEqual(a.reserved, 20 * MB)      # cached, not returned
        # the neighbours merged back into one free block of the segment
        self.assertEqual(a.free[False], [(20 * MB, min(x, y))])

    def test_best_fit_takes_the_smallest_block_that_fits(self):
        a = Allocator()
        big = a.malloc(100 * MB)
        small = a.malloc(30 * MB)
        a.release(big)
        a.release(small)
        z = a.malloc(25 * MB)
        self.assertEqual(z, small)  # the 30 MiB block, not the 100 MiB one
        self.assertEqual(a.reserved, 130 * MB)

    def test_random_segment_addresses_break_size_ties_by_address(self):
        # two free 40 MiB segments: best fit takes the one at the lower
        # address, wherever the seeded order put it
        for seed in range(5):
            a = Allocator(rng=random.Random(seed))
            first = a.malloc(40 * MB)
            second = a.malloc(40 * MB)
            self.assertNotEqual(first, second)
            a.release(first)
            a.release(second)
            self.assertEqual(a.malloc(40 * MB), min(first, second))
            self.assertEqual(a.reserved, 80 * MB)
        # the same events give the same peaks under any order here
        ev = [("mark", "build"), ("a", 1, 40 * MB), ("a", 2, 40 * MB), ("f", 1),
              ("a", 3, 30 * MB), ("f", 2), ("a", 4, 50 * MB), ("mark", "end")]
        peaks = {simulate(ev, rng=random.Random(s)).peak_reserved for s in range(5)}
        self.assertEqual(peaks, {130 * MB})

    def test_a_split_segment_strands_its_free_rest_for_a_large_request(self):
        # the mechanism behind a carried cache: a 100 MiB segment holding one
        # live 30 MiB tensor cannot serve a 90 MiB request
        a = Allocator()
        big = a.malloc(100 * MB)
        a.release(big)
        a.malloc(30 * MB)           # carved from the cached 100 MiB segment
        a.malloc(90 * MB)           # no free block of 90 MiB: a new segment
        self.assertEqual(a.reserved, 190 * MB)
        self.assertEqual(a.peak_reserved, 190 * MB)

    def test_pressure_releases_whole_free_segments_then_fails(self):
        a = Allocator(capacity=1 * GB)
        x = a.malloc(600 * MB)
        a.release(x)                # cached, whole
        a.malloc(700 * MB)          # 600 cached + 700 > 1 GiB: release, retry
        self.assertEqual(a.retries, 1)
        self.assertEqual(a.reserved, 700 * MB)
        with self.assertRaises(OutOfMemory):
            a.malloc(400 * MB)      # 700 live + 400 > 1 GiB even after release

    def test_simulate_replays_events_and_resets_peaks_at_build(self):
        ev = [("a", 1, 50 * MB), ("f", 1), ("mark", "build"),
              ("a", 2, 20 * MB), ("a", 3, 40 * MB), ("f", 2), ("mark", "end")]
        a = simulate(ev)
        # the carried 50 MiB segment serves the 20 MiB request (split: 30 MiB
        # left, too small for 40 MiB), so a 40 MiB segment is mapped
        self.assertEqual(a.peak_reserved, 90 * MB)
        self.assertEqual(a.peak_allocated, 60 * MB)


class ExpandableSegmentRules(unittest.TestCase):
    """expandable_segments:True: one growing segment per pool."""

    def test_pages_are_two_mib_small_and_twenty_mib_large(self):
        a = ExpandableAllocator()
        a.malloc(1024)
        self.assertEqual(a.reserved, 2 * MB)
        a.malloc(11 * MB)
        self.assertEqual(a.reserved, 22 * MB)

    def test_new_pages_merge_with_the_free_tail(self):
        a = ExpandableAllocator()
        a.malloc(15 * MB)           # one 20 MiB page, 5 MiB free at the end
        a.malloc(10 * MB)           # 5 free + one more page = 25: no third
        self.assertEqual(a.reserved, 40 * MB)
        a.malloc(15 * MB)           # 15 free at the end now: fits
        self.assertEqual(a.reserved, 40 * MB)

    def test_blocks_split_down_to_512_bytes(self):
        a = ExpandableAllocator()
        x = a.malloc(20 * MB)
        a.release(x)
        a.malloc(19 * MB)           # 1 MiB left: the default allocator keeps
        a.malloc(1 * MB + 512)      # it whole (not > 1 MiB); here it splits,
        # but 1 MiB + 512 B does not fit the 1 MiB rest: a page is mapped
        self.assertEqual(a.reserved, 40 * MB)
        self.assertEqual(a.allocated, 20 * MB + 512)

    def test_a_hole_too_small_grows_the_segment(self):
        a = ExpandableAllocator()
        x = a.malloc(20 * MB)
        a.malloc(20 * MB)
        a.release(x)                # a 20 MiB hole at the start
        a.malloc(30 * MB)           # does not fit it: two pages at the end
        self.assertEqual(a.reserved, 80 * MB)
        a.malloc(20 * MB)           # the hole takes this one
        self.assertEqual(a.reserved, 80 * MB)

    def test_pressure_unmaps_the_free_pages_at_the_end(self):
        a = ExpandableAllocator(capacity=200 * MB)
        a.malloc(20 * MB)
        x = a.malloc(100 * MB)
        a.release(x)                # 100 MiB free at the end, still mapped
        a.malloc(150 * MB)          # fits in 100 + 60 more: 180 <= 200
        self.assertEqual(a.reserved, 180 * MB)
        with self.assertRaises(OutOfMemory):
            a.malloc(40 * MB)       # 10 MiB free tail + 40 > 200 even after release
        self.assertEqual(a.retries, 1)

    def test_simulate_picks_the_expandable_allocator(self):
        ev = [("a", 1, 50 * MB), ("f", 1), ("mark", "build"),
              ("a", 2, 20 * MB), ("a", 3, 40 * MB), ("f", 2), ("mark", "end")]
        a = simulate(ev, expandable=True)
        # 60 MiB mapped for the carried 50; 20 and 40 fit in it after the
        # split: no growth
        self.assertEqual(a.peak_reserved, 60 * MB)
        self.assertEqual(a.peak_allocated, 60 * MB)

    def test_layout_shows_the_hole_a_freed_buffer_leaves(self):
        # a 100 MiB buffer freed below a live one and partly refilled: the
        # next 100 MiB request grows the segment, and the layout at step 1's
        # allocated peak shows the 60 MiB hole
        ev = [("mark", "build"), ("a", 1, 200 * MB), ("mark", "step 1 forward"),
              ("a", 2, 100 * MB), ("a", 3, 100 * MB), ("f", 2), ("a", 4, 40 * MB),
              ("mark", "step 1 backward"), ("a", 5, 100 * MB), ("mark", "end")]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            a = simulate(ev, expandable=True, layout=True)
        self.assertEqual(a.peak_allocated, 440 * MB)
        self.assertEqual(a.peak_reserved, 500 * MB)
        text = out.getvalue()
        self.assertIn("HOLE    0.059 GiB", text)
        self.assertIn("step 1 backward 0.098", text)


if __name__ == "__main__":
    unittest.main()
