"""The callbacks against the real frameworks on CPU: a tiny Llama built from
a config (random weights), a few optimizer steps, then the record checked
for the settings the Trainer really ran and a plausible tokens/s.

scripts/test.sh installs torch, transformers, accelerate and lightning from
PyPI; without them these tests are skipped (and say so)."""

import json
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 16


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 128, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_hf_trainer_records_what_it_ran_not_what_was_injected(tmp_path, monkeypatch):
    from gpufit.integrations.hf import GpufitCallback

    out = tmp_path / "result.json"
    monkeypatch.setenv("GPUFIT_RESULT_FILE", str(out))
    # gpufit injected 2; the script hard-codes 4 (the mismatch case).
    monkeypatch.setenv("GPUFIT_MICRO_BATCH_SIZE", "2")
    monkeypatch.setenv("GPUFIT_GRAD_ACCUM_STEPS", "4")
    # transformers 5 renamed gradient_checkpointing; either is the Trainer's switch.
    fields = transformers.TrainingArguments.__dataclass_fields__
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        **{ckpt: True},
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        include_num_input_tokens_seen=True,
        disable_tqdm=True,
    )
    cb = GpufitCallback()
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[cb])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rec = json.loads(out.read_text())
    assert cb.written == [str(out)]
    assert rec["source"] == "hf" and rec["outcome"] == "completed" and rec["steps"] == 3
    assert rec["ran"] == {
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "dtype": "fp32",
        "activation_checkpointing": True,
        "compile": False,
        "num_workers": 0,
    }
    assert rec["injected"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 4}
    # 3 steps × 2 micro batches × 4 samples × 16 tokens, within the training's wall time.
    tokens = 3 * 2 * 4 * SEQ
    assert rec["tokens_per_sec"] * rec["duration_sec"] == pytest.approx(tokens, rel=1e-6)
    assert rec["duration_sec"] <= wall
    assert tokens / wall <= rec["tokens_per_sec"] < 1e7


def test_lightning_trainer_records_precision_accumulation_and_loader_batch(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from gpufit.integrations.lightning import GpufitCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.randint(0, 128, (64, SEQ), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=0)
    out = tmp_path / "result.json"
    cb = GpufitCallback(result_file=str(out), activation_checkpointing=False)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    t0 = time.perf_counter()
    trainer.fit(Module(), loader)
    wall = time.perf_counter() - t0
    rec = json.loads(out.read_text())
    assert rec["source"] == "lightning" and rec["outcome"] == "completed"
    assert rec["ran"] == {
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "dtype": "bf16-mixed",
        "num_workers": 0,
        "activation_checkpointing": False,
    }
    assert rec["steps"] == 3
    tokens = 3 * 2 * 4 * SEQ
    assert rec["tokens_per_sec"] * rec["duration_sec"] == pytest.approx(tokens, rel=1e-6)
    assert tokens / wall <= rec["tokens_per_sec"] < 1e7
