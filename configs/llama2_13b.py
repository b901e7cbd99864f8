r"""A ParallelSpec drafter for Llama-2-13B-chat (target frozen in bf16, drafter trained in f32).

Variants (`configs/common.py`): `pspec` (default), `eagle`, `medusa`; a hardware preset for
`--dry_run` (default v4-32); `smoke` (this recipe on the embedded default target, seconds).

Hardware: a TPU v4-32 slice (16 chips on 4 hosts, FSDP over all of them), or one 80 GB GPU
(`:gpu-80gb`: one process, 8 microbatches). Expected time for the 10k steps of 64 x 2048 tokens:
about 6 hours on a v4-32 (estimated from FLOPs at 40% utilisation; the progress bar shows the
real rate). Launch on every worker of the slice (tpu_scripts/ does this), with the checkpoint on
each host or a shared disk:

  python -m train.selfdistill --config=configs/llama2_13b.py \
    --config.target.checkpoint=/data/Llama-2-13b-chat-hf
  python -m train.distill --config=configs/llama2_13b.py \
    --config.target.checkpoint=/data/Llama-2-13b-chat-hf --workdir=gs://YOUR_BUCKET/llama2_13b
  python -m train.distill --config=configs/llama2_13b.py --dry_run   # memory plan only
"""

from configs import common
from pspec_jax import presets


def get_config(arg: str | None = None):
  return common.large_config(presets.LLAMA2_13B, "/data/Llama-2-13b-chat-hf", arg)
