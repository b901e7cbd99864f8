r"""Drafters for the embedded default target, SmolLM2-135M-Instruct, trained on a CPU.

Variants (`configs/common.py`): `pspec` (default), `eagle`, `medusa`; `smoke` (seconds; tests).

  # 1. Regenerate ShareGPT answers with the target (self-distillation data; resumable):
  python -m train.selfdistill --config=configs/smollm2_135m.py
  # 2. Train and export each drafter (resumes from --workdir when restarted):
  python -m train.distill --config=configs/smollm2_135m.py --workdir=workdirs/smollm2_pspec
  python -m train.distill --config=configs/smollm2_135m.py:eagle --workdir=workdirs/smollm2_eagle
  python -m train.distill --config=configs/smollm2_135m.py:medusa --workdir=workdirs/smollm2_medusa

Hardware: one CPU host (2 cores suffice), float32; drafters/README.md has the times.
"""

from configs import common
from pspec_jax import presets


def get_config(arg: str | None = None):
  c = common.training_config(
    checkpoint="smollm2-135m-instruct",
    arch=presets.SMOLLM2_135M,
    dtype="float32",
    hardware="cpu",
    mesh=dict(data=-1, fsdp=1, tensor=1),
  )
  c.data.seq_len = 512
  # The 16k tokens the target writes most often hold 97% of held-out answers (see the drafter
  # README); a third of the LM head's cost, in training and in every draft pass.
  c.drafter.draft_vocab_size = 16384
  # The 30-layer target costs twice the drafter's whole step: run it once per row, not per
  # epoch and drafter (~1.2 GB of features for 2000 conversations).
  c.data.cache_features = True
  c.loss.remat = False  # the logits of a chunk fit; recomputing them costs a third more
  c.train.update(
    batch_size=8,
    steps=2000,
    lr=1e-3,
    warmup_steps=100,
    clip_norm=1.0,
    log_every=10,
    eval_every=200,
    eval_batches=4,
    checkpoint_every=100,
    keep_checkpoints=2,
  )
  c.selfdistill.update(
    num_conversations=20000,
    max_prompt_tokens=256,
    # Decoding on MT-Bench sees an answer's first 128 tokens; past them the target's long
    # answers are mostly repetition loops (54% of the tokens of 256-token answers).
    max_new_tokens=128,
    # Wide batches: on a CPU a batch of 32 costs about 4x one sequence's step.
    batch_size=32,
    shard_size=64,
  )
  c.data.source = c.selfdistill.out  # train on the self-distilled answers
  return common.apply_variants(c, arg)
