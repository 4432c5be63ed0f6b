#!/usr/bin/env python3
"""Replay a training step's allocations through a model of PyTorch's CUDA
caching allocator, without a GPU.

Two parts:

1. trace: the Hugging Face step of scripts/gpu_measure.py (model built from
   its config numbers, optional peft LoRA and non-reentrant checkpointing,
   `model(input_ids, labels=...).loss`, backward, `torch.optim.AdamW` with
   the foreach implementation CUDA uses by default, `zero_grad(set_to_none)`)
   runs on *fake* CPU tensors (torch._subclasses.FakeTensorMode: shapes and
   dtypes, no memory, no arithmetic). A TorchDispatchMode sees every ATen op
   and records when each new storage is born (its bytes) and when the last
   tensor on it dies: the same sequence of requests and releases the CUDA
   allocator receives (autograd frees by reference count on either device).
   CPU kernels stand in for CUDA's where they allocate the same (SDPA: the
   CPU flash kernel, which like CUDA's keeps the output and an fp32
   logsumexp). Where they do not, the replay is not CUDA's: SDPA with
   attention dropout (BERT) falls back to the math kernel on the CPU, and
   CPU autocast's op lists differ from CUDA's in places; Falcon's SDPA is
   forced to the math kernel, as CUDA runs it.

2. simulate: the allocator's rules from c10/cuda/CUDACachingAllocator.cpp
   (PyTorch 2.x, default settings):
   - sizes round up to 512 bytes; requests up to 1 MiB use the small pool,
     larger ones the large pool;
   - a request is served best-fit from the pool's free cached blocks
     (smallest block that is large enough); a block is split when the rest
     is >= 512 B (small pool) or > 1 MiB (large pool);
   - when no cached block fits, a new segment is mapped: 2 MiB for the small
     pool, 20 MiB for requests under 10 MiB, else the size rounded up to
     2 MiB;
   - a freed block merges with free neighbours in its segment and stays
     cached; if mapping a segment would exceed the card, every cached
     segment with no live block is returned first and the mapping retried
     (otherwise: out of memory).
   Reserved bytes are the mapped segments; their peak is what
   `torch.cuda.max_memory_reserved()` reports.

`--carry MODEL[:dtype]` first builds another model and frees it without
returning its segments, as scripts/gpu_measure.py did between points before
it recorded `reserved_at_start` (bench/data/h100/README.md, "A carried
cache").

Usage (a Python with torch, transformers, peft; no GPU):
    python scripts/alloc_sim.py Qwen/Qwen2.5-0.5B --method full --mb 1 --seq 512
    python scripts/alloc_sim.py meta-llama/Llama-3.2-3B --method lora --mb 1 --seq 8192 \\
        --ckpt --carry mistralai/Mistral-7B-v0.1
    python scripts/alloc_sim.py gemma-2b --framework litgpt --method lora --all-linear \
        --lora-dropout 0.1 --mb 2 --seq 512
(with litgpt installed for --framework litgpt)
"""

import argparse
import bisect
import os
import pickle
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_measure import LORA_TARGETS, MODELS, config_for  # noqa: E402

KB, MB = 1024, 1024 * 1024
K_MIN_BLOCK = 512            # kMinBlockSize
K_SMALL_SIZE = 1 * MB        # kSmallSize: largest small-pool request
K_SMALL_BUFFER = 2 * MB      # kSmallBuffer: small-pool segment
K_LARGE_BUFFER = 20 * MB     # kLargeBuffer: segment for requests < kMinLargeAlloc
K_MIN_LARGE_ALLOC = 10 * MB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MB       # kRoundLarge
H100_BYTES = 81_559 * MB     # the NVML total of the H100 in bench/data/h100/


class OutOfMemory(Exception):
    pass


class Allocator:
    """The caching allocator's bookkeeping (one stream, default config)."""

    def __init__(self, capacity=H100_BYTES, context=0, rng=None):
        self.capacity = capacity - context
        # With `rng`, each new segment gets an address drawn at random
        # instead of the next one up: cudaMalloc's addresses follow the
        # process's earlier mappings (a model built and freed before), and
        # best fit breaks ties between free blocks of one size by address
        # (BlockComparatorSize: stream, size, then pointer).
        self.rng = rng
        self.used_addrs = set()
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.next_addr = 0
        # free blocks per pool, sorted by (size, addr)
        self.free = {True: [], False: []}
        # addr -> [size, segment_id, is_free, small]
        self.blocks = {}
        self.seg_blocks = {}   # segment id -> sorted list of block addrs
        self.seg_size = {}
        self.retries = 0

    @staticmethod
    def round_size(n):
        return max(K_MIN_BLOCK, (n + K_MIN_BLOCK - 1) // K_MIN_BLOCK * K_MIN_BLOCK)

    @staticmethod
    def segment_size(n):
        if n <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if n < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return (n + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE

    def _map(self, size, small):
        if self.reserved + size > self.capacity:
            self.retries += 1
            self.release_cached()
            if self.reserved + size > self.capacity:
                raise OutOfMemory(f"mapping {size / 2**30:.2f} GiB with {self.reserved / 2**30:.2f} "
                                  f"GiB reserved, {self.allocated / 2**30:.2f} GiB allocated")
        if self.rng is None:
            addr = self.next_addr
            self.next_addr += size + K_ROUND_LARGE  # segments are never adjacent
        else:
            # 1 TiB slots: no segment reaches the next one
            addr = self.rng.randrange(1 << 20) << 40
            while addr in self.used_addrs:
                addr = self.rng.randrange(1 << 20) << 40
            self.used_addrs.add(addr)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.seg_size[addr] = size
        self.blocks[addr] = [size, addr, True, small]
        self.seg_blocks[addr] = [addr]
        bisect.insort(self.free[small], (size, addr))
        return addr

    def release_cached(self):
        """release_cached_blocks(): unmap every segment with no live block."""
        for seg, addrs in list(self.seg_blocks.items()):
            if len(addrs) == 1 and self.blocks[addrs[0]][2]:
                b = self.blocks.pop(addrs[0])
                self.free[b[3]].remove((b[0], addrs[0]))
                del self.seg_blocks[seg]
                self.reserved -= self.seg_size.pop(seg)

    def _make_room(self, size, small):
        """No cached block fits: map a segment for the request."""
        self._map(self.segment_size(size), small)

    @staticmethod
    def _should_split(rest, small):
        """`should_split`: a small block splits when >= 512 B are left, a
        large one only when more than 1 MiB is."""
        return rest >= K_MIN_BLOCK if small else rest > K_SMALL_SIZE

    def malloc(self, nbytes):
        size = self.round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = self.free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            self._make_room(size, small)
            i = bisect.bisect_left(pool, (size, -1))
        bsize, addr = pool.pop(i)
        b = self.blocks[addr]
        rest = bsize - size
        if self._should_split(rest, small):
            b[0] = size
            naddr = addr + size
            self.blocks[naddr] = [rest, b[1], True, small]
            bisect.insort(self.seg_blocks[b[1]], naddr)
            bisect.insort(pool, (rest, naddr))
        b[2] = False
        self.allocated += b[0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return addr

    def release(self, addr):
        b = self.blocks[addr]
        b[2] = True
        self.allocated -= b[0]
        seg = self.seg_blocks[b[1]]
        # merge with the free neighbours in the segment
        j = bisect.bisect_left(seg, addr)
        if j + 1 < len(seg) and self.blocks[seg[j + 1]][2]:
            n = seg.pop(j + 1)
            nb = self.blocks.pop(n)
            self.free[b[3]].remove((nb[0], n))
            b[0] += nb[0]
        if j > 0 and self.blocks[seg[j - 1]][2]:
            p = seg[j - 1]
            pb = self.blocks[p]
            self.free[b[3]].remove((pb[0], p))
            pb[0] += b[0]
            seg.pop(j)
            del self.blocks[addr]
            addr, b = p, pb
        bisect.insort(self.free[b[3]], (b[0], addr))


class ExpandableAllocator(Allocator):
    """`expandable_segments:True` (PyTorch >= 2.1): each pool is one
    segment of reserved virtual addresses whose pages are mapped on demand
    (`ExpandableSegment`; pages of kSmallBuffer = 2 MiB for the small pool
    and kLargeBuffer = 20 MiB for the large one). A request is served
    best-fit from the mapped free blocks, which split whenever the rest is
    >= 512 B (`should_split`); when none fits, pages are mapped at the
    segment's end, merged with a free block already there
    (`try_allocate_expandable_block`: "free -> unmapped"). Freed blocks
    merge with their neighbours and stay mapped. Under pressure
    (`release_cached_blocks`) this model unmaps only the free pages at the
    end of each segment, where PyTorch also unmaps whole free pages inside
    it: it may fail a little earlier than the real allocator."""

    def __init__(self, capacity=H100_BYTES, context=0):
        super().__init__(capacity, context)
        self.segment = {}  # pool (small?) -> its segment's first address
        for small in (True, False):
            seg = self.next_addr
            self.next_addr += 1 << 50  # virtual room; segments never adjacent
            self.seg_blocks[seg] = []
            self.seg_size[seg] = 0
            self.segment[small] = seg

    def _grow(self, size, small):
        seg = self.segment[small]
        addrs = self.seg_blocks[seg]
        tail = addrs[-1] if addrs and self.blocks[addrs[-1]][2] else None
        have = self.blocks[tail][0] if tail is not None else 0
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        grow = (size - have + page - 1) // page * page
        if self.reserved + grow > self.capacity:
            self.retries += 1
            self.release_cached()
            return self._grow(size, small) if self.reserved + grow <= self.capacity else \
                self._fail(grow)
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        end = seg + self.seg_size[seg]
        self.seg_size[seg] += grow
        if tail is not None:
            b = self.blocks[tail]
            self.free[small].remove((b[0], tail))
            b[0] += grow
            bisect.insort(self.free[small], (b[0], tail))
        else:
            self.blocks[end] = [grow, seg, True, small]
            addrs.append(end)
            bisect.insort(self.free[small], (grow, end))

    def _fail(self, grow):
        raise OutOfMemory(f"mapping {grow / 2**30:.2f} GiB with {self.reserved / 2**30:.2f} "
                          f"GiB reserved, {self.allocated / 2**30:.2f} GiB allocated")

    def release_cached(self):
        for seg, addrs in self.seg_blocks.items():
            if addrs and self.blocks[addrs[-1]][2]:
                tail = addrs[-1]
                b = self.blocks[tail]
                page = K_SMALL_BUFFER if b[3] else K_LARGE_BUFFER
                # whole pages past the last live byte
                keep = -(-(tail - seg) // page) * page - (tail - seg)
                cut = b[0] - keep
                if cut <= 0:
                    continue
                self.free[b[3]].remove((b[0], tail))
                self.reserved -= cut
                self.seg_size[seg] -= cut
                if keep:
                    b[0] = keep
                    bisect.insort(self.free[b[3]], (keep, tail))
                else:
                    del self.blocks[tail]
                    addrs.pop()

    def _make_room(self, size, small):
        self._grow(size, small)

    @staticmethod
    def _should_split(rest, small):
        # with expandable segments every pool splits down to 512 B
        return rest >= K_MIN_BLOCK


def capture(args, carry=None):
    """Run the step on fake CPU tensors; return the event list
    [("a", key, bytes) | ("f", key) | ("mark", name)]."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from torch.multiprocessing.reductions import StorageWeakRef

    events = []
    live = {}   # storage address -> weak reference to the storage

    def poll():
        # storages whose last tensor died since the last op (autograd and
        # Python free between ops, so op granularity is the allocator's)
        for k, ref in list(live.items()):
            if ref.expired():
                del live[k]
                events.append(("f", k))

    def track(t):
        try:
            st = t.untyped_storage()
        except Exception:  # storage-less tensors allocate nothing here
            return
        k = st._cdata
        if k in live and not live[k].expired():
            return  # a view, or the op's input returned
        if k in live:  # the address was freed and reused within one op
            events.append(("f", k))
        n = st.nbytes()
        if n == 0:
            return
        live[k] = StorageWeakRef(st)
        events.append(("a", k, n))

    # cuBLAS workspaces: PyTorch gives each cuBLAS handle (one per thread:
    # the main thread's forward and optimizer, autograd's thread for the
    # backward) a workspace from the caching allocator at the handle's first
    # matmul, and keeps it for the process. A job's first step makes both,
    # between its activations. Placed just before the op's output (PyTorch
    # allocates the output first; replayed after it, Llama-3.2-1B full bf16
    # 4 x 2,048 checkpointed gives 21.16 GiB instead of 21.04 and Gemma 2
    # LoRA 4 x 1,024 the same 28.85: BENCHMARKS.md, twelfth session).
    ws_bytes = int(getattr(args, "workspaces_mib", 0) * MB)
    ws_made = set()
    matmuls = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
    phase = {"thread": "main"}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            poll()
            if ws_bytes and phase["thread"] not in ws_made and \
                    func.overloadpacket.__name__ in matmuls:
                ws_made.add(phase["thread"])
                events.append(("a", ("workspace", phase["thread"]), ws_bytes))
            out = func(*a, **(kw or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    track(t)
            return out

    def mark(name):
        poll()
        events.append(("mark", name))
        phase["thread"] = "autograd" if name.endswith("backward") else "main"

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from peft import LoraConfig, get_peft_model

    def build(model_name, dtype, method, ckpt, attention, targets=None, head="lm"):
        mt, config = config_for(model_name)
        pdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        cls = AutoModelForSequenceClassification if head == "classifier" else AutoModelForCausalLM
        m = cls.from_config(config, dtype=pdt, attn_implementation=attention)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method == "lora":
            # PEFT moves its adapters to the base layer's device and casts
            # them to fp32, which on fake parameters torch refuses to swap;
            # nn.Linear makes them in fp32 on the same (fake CPU) device
            # already, so the move is skipped
            to = torch.nn.Module.to
            torch.nn.Module.to = lambda self, *a, **k: self
            try:
                m = get_peft_model(m, LoraConfig(
                    r=16, lora_alpha=32, lora_dropout=0.0,
                    target_modules=targets or LORA_TARGETS[mt],
                    task_type="SEQ_CLS" if head == "classifier" else None))
            finally:
                torch.nn.Module.to = to
        m.train()
        return m, config

    # SDPA with attention dropout (BERT in training): CUDA runs the
    # memory-efficient kernel (`_efficient_attention_forward`), which keeps
    # the output, an fp32 logsumexp padded to 32 queries and the dropout RNG
    # seed/offset (no mask: backward regenerates it); its backward makes
    # q/k/v gradients and an fp32 `delta` row sum. The CPU has no such
    # kernel (it falls back to the math one, which keeps the scores), so
    # the replay stands in a function that allocates what CUDA's does.
    import torch.nn.functional as F
    sdpa = F.scaled_dot_product_attention

    class EfficientDropoutAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            b, h, s, d = q.shape
            out = q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)
            lse = q.new_empty((b, h, (s + 31) // 32 * 32), dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, out, lse = ctx.saved_tensors
            delta = q.new_empty(lse.shape, dtype=torch.float32)
            gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            del delta
            return gq, gk, gv

    # Dropout in training: CUDA runs the fused `native_dropout`, which keeps
    # a 1-byte bool mask; the CPU path (`at::dropout` without the fused
    # kernel) keeps a mask in the input's dtype, 2 or 4 bytes an element.
    # The stand-in allocates what CUDA's kernel does: the output and a bool
    # mask kept for backward, which makes one gradient.
    class CudaDropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
            ctx.save_for_backward(mask)
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # noqa: B018 (the mask is read by the kernel)
            return torch.empty_like(g)

    dropout = F.dropout

    def cuda_dropout(x, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and torch.is_grad_enabled() and x.requires_grad:
            return CudaDropout.apply(x)
        return dropout(x, p, training, inplace)

    def sdpa_cuda(q, k, v, attn_mask=None, dropout_p=0.0, *a, **kw):
        if dropout_p > 0.0 and torch.is_grad_enabled():
            # the mask, if any, is read as a bias: nothing more is kept
            return EfficientDropoutAttention.apply(q, k, v)
        return sdpa(q, k, v, attn_mask, dropout_p, *a, **kw)

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    F.scaled_dot_product_attention = sdpa_cuda
    F.dropout = cuda_dropout
    # patched for this capture only: restored however it ends, so a caller
    # (a test, replay_grid) runs the real functions afterwards
    try:
        if getattr(args, "framework", "hf") == "litgpt":
            with fake, Track():
                litgpt_steps(args, mark)
            return events
        with fake, Track():
            if carry:
                name, _, dt = carry.partition(":")
                mark(f"carry {name}")
                # eager: every family has it, and it does not change the weights
                m, _ = build(name, dt or "bf16", "full", False, "eager")
                del m
                import gc
                gc.collect()
                mark("carry freed")
            mark("build")
            model, config = build(args.model, args.dtype, args.method, args.ckpt, args.attention,
                                  "all-linear" if args.all_linear else None, args.head)
            mixed = args.dtype in ("bf16-mixed", "fp16-mixed")
            params = [p for p in model.parameters() if p.requires_grad]
            if args.optimizer == "adafactor":
                # as scripts/gpu_measure.py runs it: one parameter at a time
                from transformers.optimization import Adafactor
                opt = Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False,
                                warmup_init=False)
            else:
                opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
            x = torch.randint(0, config.vocab_size, (args.mb, args.seq))
            labels = torch.randint(0, 2, (args.mb,)) if args.head == "classifier" else x
            # Falcon's single K/V head: CUDA's flash and memory-efficient SDPA
            # kernels refuse the unexpanded head, so torch falls back to the math
            # kernel, which materialises the scores (the CPU kernel would not)
            import contextlib
            from torch.nn.attention import SDPBackend, sdpa_kernel
            math_sdpa = config.model_type == "falcon" and args.attention == "sdpa"
            for step in range(args.steps):
                mark(f"step {step} forward")
                adt = torch.float16 if args.dtype == "fp16-mixed" else torch.bfloat16
                with torch.autocast("cpu", dtype=adt, enabled=mixed), \
                        (sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()):
                    loss = model(input_ids=x, labels=labels).loss
                mark(f"step {step} backward")
                with sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext():
                    loss.backward()
                mark(f"step {step} optimizer")
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
            mark("end")
        return events
    finally:
        F.scaled_dot_product_attention = sdpa
        F.dropout = dropout


def litgpt_steps(args, mark):
    """litgpt's fine-tuning loop (litgpt/finetune/lora.py and full.py, `fit`)
    on the fake tensors: bf16-true or 32-true (Fabric builds and runs the
    model under that default dtype), LoRA with litgpt's own layers (rank
    --lora-r, `lora_dropout` --lora-dropout, q and v or with --all-linear
    every linear and the head), the output head in 128-token chunks and
    `chunked_cross_entropy` (LoRA) or the whole head and the chunked loss
    on its shifted view (full), `AdamW` (foreach, as on CUDA),
    `zero_grad()`. The loop's `logits` stays referenced until the next
    step's forward returns, as in `fit`."""
    import torch
    from litgpt.lora import GPT as LoraGPT, Config as LoraConfig, mark_only_lora_as_trainable
    from litgpt.model import GPT, Config
    from litgpt.utils import chunked_cross_entropy

    if args.ckpt or args.carry or args.head != "lm" or args.dtype not in ("bf16", "fp32"):
        raise SystemExit("litgpt: bf16 or fp32, causal-LM head, no checkpointing or --carry")
    name = args.model.split("/")[-1]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    try:
        mark("build")
        if args.method == "lora":
            every = args.all_linear
            model = LoraGPT(LoraConfig.from_name(
                name, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                lora_dropout=args.lora_dropout, lora_query=True, lora_value=True,
                lora_key=every, lora_projection=every, lora_mlp=every, lora_head=every))
            mark_only_lora_as_trainable(model)
        else:
            model = GPT(Config.from_name(name))
        model.max_seq_length = args.seq
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                lr=2e-4, foreach=True)
        x = torch.randint(0, model.config.padded_vocab_size, (args.mb, args.seq))
        for step in range(args.steps):
            mark(f"step {step} forward")
            if args.method == "lora":
                logits = model(x, lm_head_chunk_size=128)
                logits[-1] = logits[-1][..., :-1, :]
                loss = chunked_cross_entropy(logits, x[..., 1:])
            else:
                logits = model(x)
                loss = chunked_cross_entropy(logits[..., :-1, :], x[..., 1:])
            mark(f"step {step} backward")
            loss.backward()
            mark(f"step {step} optimizer")
            opt.step()
            opt.zero_grad()
        mark("end")
    finally:
        torch.set_default_dtype(default)


def drive(alloc, events):
    """Carries out `events` on `alloc` one by one, yielding after each
    (index, event, the phase it falls in, the block an allocation got)."""
    addr = {}
    phase = "?"
    for i, e in enumerate(events):
        got = None
        if e[0] == "a":
            got = addr[e[1]] = alloc.malloc(e[2])
        elif e[0] == "f":
            a = addr.pop(e[1], None)
            if a is not None:
                alloc.release(a)
        else:
            phase = e[1]
        yield i, e, phase, got


def simulate(events, capacity=H100_BYTES, context=0, verbose=False, expandable=False,
             layout=False, rng=None):
    alloc = ExpandableAllocator(capacity, context) if expandable else \
        Allocator(capacity, context, rng)
    marks = []
    peak_at = None  # index of the event that set step 1's allocated peak
    peak = 0
    for i, e, phase, got in drive(alloc, events):
        if got is not None:
            if phase.startswith("step 1") and alloc.allocated >= peak:
                peak, peak_at = alloc.allocated, i
        elif e[0] == "mark":
            if e[1] == "build":
                # the point's own peaks start here (reset_peak_memory_stats)
                alloc.peak_reserved, alloc.peak_allocated = alloc.reserved, alloc.allocated
            marks.append((e[1], alloc.reserved, alloc.allocated, alloc.peak_reserved,
                          alloc.peak_allocated))
    if verbose:
        for name, r, a, pr, pa in marks:
            print(f"  {name:<24} reserved {r / 2**30:7.2f} allocated {a / 2**30:7.2f} "
                  f"(peaks so far {pr / 2**30:7.2f} / {pa / 2**30:7.2f} GiB)")
    if layout and peak_at is not None:
        print_layout(*layout_at(events, peak_at, capacity, context, expandable),
                     expandable=expandable)
    return alloc


def layout_at(events, last, capacity, context, expandable):
    """Replays `events` up to index `last` (the same allocator, so the same
    state) and returns (allocated, reserved, large-pool blocks), each block
    as (size, free, phase that allocated it, segment)."""
    alloc = (ExpandableAllocator if expandable else Allocator)(capacity, context)
    born = {}
    for _, _, phase, got in drive(alloc, events[:last + 1]):
        if got is not None:
            born[got] = phase
    blocks = {k: (b[0], b[2], born.get(k, "?"), b[1])
              for k, b in alloc.blocks.items() if not b[3]}
    return alloc.allocated, alloc.reserved, blocks


def print_layout(allocated, reserved, blocks, expandable=False):
    """The large pool by address at step 1's allocated peak: runs of live
    blocks (GiB, by the phase that allocated them) and the free blocks of
    32 MiB or more between them — the holes that keep reserved bytes above
    allocated ones — and, for the default allocator, where a segment ends."""
    print(f"large pool at step 1's allocated peak: allocated {allocated / 2**30:.2f} GiB, "
          f"reserved {reserved / 2**30:.2f} GiB")
    run = {}

    def flush():
        if run:
            total = sum(run.values())
            parts = ", ".join(f"{p} {v / 2**30:.3f}" for p, v in run.items())
            print(f"    live {total / 2**30:8.3f} GiB  ({parts})")
            run.clear()

    seg = None
    for k in sorted(blocks):
        size, free, born, in_seg = blocks[k]
        if in_seg != seg and seg is not None and not expandable:
            flush()
            print("    --- next segment")
        seg = in_seg
        if free and size >= 32 * MB:
            flush()
            print(f"    HOLE {size / 2**30:8.3f} GiB")
        elif not free:
            run[born] = run.get(born, 0) + size
    flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face id of scripts/gpu_measure.py's MODELS, or "
                                   "with --framework litgpt a name litgpt's Config knows")
    ap.add_argument("--framework", choices=["hf", "litgpt"], default="hf",
                    help="the training loop: scripts/gpu_measure.py's, or litgpt's fit")
    ap.add_argument("--lora-r", type=int, default=8, help="litgpt LoRA rank")
    ap.add_argument("--lora-dropout", type=float, default=0.05, help="litgpt lora_dropout")
    ap.add_argument("--method", choices=["full", "lora"], default="full")
    ap.add_argument("--dtype", choices=["bf16", "bf16-mixed", "fp16-mixed", "fp32"],
                    default="bf16")
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--all-linear", action="store_true", help="LoRA on every linear layer")
    ap.add_argument("--head", choices=["lm", "classifier"], default="lm",
                    help="causal-LM loss, or a sequence classifier (2 labels)")
    ap.add_argument("--optimizer", choices=["adamw", "adafactor"], default="adamw")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workspaces-mib", type=float, default=0,
                    help="the cuBLAS workspace of each handle (main thread, autograd's), made "
                         "at its first matmul inside the first step, as in a job that ran no "
                         "matmul before training (32 on Hopper: the 64 MiB every measured row "
                         "allocates beyond the replay)")
    ap.add_argument("--carry", help="MODEL[:bf16|fp32] built and freed first, its cache kept")
    ap.add_argument("--capacity-mib", type=float, default=H100_BYTES / MB,
                    help="the card's memory (default: the H100's NVML total)")
    ap.add_argument("--context-mib", type=float, default=610,
                    help="the CUDA context and kernels outside the allocator (H100: ~610)")
    ap.add_argument("--expandable", action="store_true",
                    help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    ap.add_argument("--min-capacity", action="store_true",
                    help="also find the least memory (to 1/8 GiB) the allocator needs to run "
                         "the steps, releasing its cache under pressure, without failing")
    ap.add_argument("--layout", action="store_true",
                    help="print the large pool's blocks at step 1's allocated peak: live runs "
                         "and the holes between them")
    ap.add_argument("--address-seeds", type=int, default=0,
                    help="also replay the steps N more times, each with the segments' "
                         "addresses in another random order (seeds 0..N-1), and print the "
                         "spread of the reserved peak: how much of it depends on where "
                         "cudaMalloc puts each segment, which the configuration does not fix")
    ap.add_argument("--events", help="a file of captured events: read if it exists (the "
                                     "capture is skipped), else written after the capture")
    ap.add_argument("--json", help="append the result (with --min-capacity's) as one JSON line "
                                   "to this file")
    args = ap.parse_args()
    if args.framework == "hf" and args.model not in MODELS:
        ap.error(f"unknown model {args.model!r}; known: {', '.join(sorted(MODELS))}")
    if args.events and os.path.exists(args.events):
        with open(args.events, "rb") as f:
            events = pickle.load(f)
    else:
        events = capture(args, args.carry)
        if args.events:
            with open(args.events, "wb") as f:
                pickle.dump(events, f)
    if args.min_capacity or args.json:
        free = simulate(events, capacity=1 << 62, expandable=args.expandable)
        lo, hi = free.peak_allocated, free.peak_reserved  # fits at hi, not below lo
        while hi - lo > (1 << 27):
            mid = (lo + hi) // 2
            try:
                simulate(events, capacity=mid, expandable=args.expandable)
                hi = mid
            except OutOfMemory:
                lo = mid
        need = hi
        print(f"least allocator memory that runs it: {need / 2**30:.2f} GiB "
              f"(unpressed reserved peak {free.peak_reserved / 2**30:.2f}, "
              f"allocated peak {free.peak_allocated / 2**30:.2f})")
        if args.json:
            import json
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(model=args.model, method=args.method, dtype=args.dtype,
                                        all_linear=args.all_linear,
                                        mb=args.mb, seq=args.seq, ckpt=args.ckpt,
                                        attention=args.attention, carry=args.carry,
                                        expandable=args.expandable,
                                        allocated=free.peak_allocated,
                                        reserved=free.peak_reserved, least=need)) + "\n")
    try:
        a = simulate(events, capacity=int(args.capacity_mib * MB),
                     context=int(args.context_mib * MB), verbose=True,
                     expandable=args.expandable, layout=args.layout)
    except OutOfMemory as e:
        print(f"{args.model} {args.method} {args.dtype} m{args.mb} s{args.seq} "
              f"ckpt={args.ckpt} carry={args.carry}: out of memory ({e})")
        return 1
    print(f"{args.model} {args.method} {args.dtype} m{args.mb} s{args.seq} "
          f"ckpt={args.ckpt} carry={args.carry}: peak allocated "
          f"{a.peak_allocated / 2**30:.2f} GiB, peak reserved {a.peak_reserved / 2**30:.2f} GiB, "
          f"cache releases {a.retries}")
    if args.address_seeds:
        peaks = []
        for seed in range(args.address_seeds):
            try:
                b = simulate(events, capacity=int(args.capacity_mib * MB),
                             context=int(args.context_mib * MB), rng=random.Random(seed))
                peaks.append(b.peak_reserved / 2**30)
            except OutOfMemory:
                peaks.append(float("inf"))
        print(f"peak reserved over {len(peaks)} segment address orders (GiB): "
              + " ".join(f"{p:.2f}" for p in peaks))
        print(f"  min {min(peaks):.2f}, median {statistics.median(peaks):.2f}, "
              f"max {max(peaks):.2f} (ascending addresses: {a.peak_reserved / 2**30:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
