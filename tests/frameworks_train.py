"""A few CPU training steps of a tiny model under a real framework, with ncclwatch's callback.

Run by tests/test_framework_callbacks.py with the frameworks venv's Python (setup.sh makes
it): ``python frameworks_train.py lightning|hf OUT_DIR``. The spool and job come from
NCCLWATCH_SPOOL_DIR and NCCLWATCH_JOB_ID. No download: the models are built from configs.
"""

from __future__ import annotations

import sys

# torch and the frameworks are imported inside the functions: pytest's doctest collection
# imports this file in the test venv, which has none of them.
VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 6


def lightning_run(out_dir: str) -> None:
    import lightning as L
    import torch
    from ncclwatch.ingest.lightning_callback import NcclwatchCallback

    class TinyLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 32)
            self.out = torch.nn.Linear(32, VOCAB)

        def training_step(self, batch, batch_idx):
            x = batch["input_ids"]
            logits = self.out(self.emb(x))
            return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), x.view(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(BATCH * STEPS * 2)]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, accumulate_grad_batches=2,
        callbacks=[NcclwatchCallback()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyLM(), loader)
    trainer.save_checkpoint(f"{out_dir}/last.ckpt")  # the callback says the save begins


def hf_run(out_dir: str) -> None:
    import torch
    from ncclwatch.ingest.hf_callback import NcclwatchTrainerCallback
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return BATCH * STEPS

        def __getitem__(self, i):
            x = torch.randint(0, VOCAB, (SEQ,))
            return {"input_ids": x, "labels": x}

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=BATCH, use_cpu=True,
        include_num_input_tokens_seen=True, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[NcclwatchTrainerCallback()]).train()


if __name__ == "__main__":
    import torch

    torch.manual_seed(0)
    if sys.argv[1] == "lightning":
        lightning_run(sys.argv[2])
    else:
        hf_run(sys.argv[2])
