"""Presets the programs share: hardware (devices and memory per device) and published Llama
architectures by name, for planning and profiling without a checkpoint."""

__all__ = [
  "ARCHITECTURES",
  "HARDWARE",
  "LLAMA2_13B",
  "LLAMA2_7B",
  "LLAMA3_8B",
  "SMOLLM2_135M",
  "VICUNA_13B",
  "VICUNA_7B",
  "not_this_host",
  "platform",
]

# name -> (devices as JAX sees them, memory per device in GiB). TPU v4 chips appear as one
# device each (megacore), so v4-32 (32 TensorCores) is 16 devices.
HARDWARE = {
  "cpu": (1, 24.0),
  "v4-8": (4, 32.0),
  "v4-32": (16, 32.0),
  "v5e-16": (16, 16.0),
  "gpu-80gb": (1, 80.0),
}

SMOLLM2_135M = dict(
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  rope_theta=100000.0,
  rms_norm_eps=1e-5,
  tie_embeddings=True,
  max_position_embeddings=8192,
)

# Published architectures (the checkpoints' config.json).
LLAMA2_7B = dict(
  vocab_size=32000,
  hidden_size=4096,
  intermediate_size=11008,
  num_layers=32,
  num_heads=32,
  num_kv_heads=32,
  rope_theta=10000.0,
  rms_norm_eps=1e-5,
  tie_embeddings=False,
  max_position_embeddings=4096,
)
LLAMA2_13B = LLAMA2_7B | dict(
  hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40
)
# Vicuna v1.3 (the speculative-decoding benchmark targets) is fine-tuned Llama-1: 2k context.
VICUNA_7B = LLAMA2_7B | dict(rms_norm_eps=1e-6, max_position_embeddings=2048)
VICUNA_13B = LLAMA2_13B | dict(rms_norm_eps=1e-6, max_position_embeddings=2048)
LLAMA3_8B = dict(
  vocab_size=128256,
  hidden_size=4096,
  intermediate_size=14336,
  num_layers=32,
  num_heads=32,
  num_kv_heads=8,
  rope_theta=500000.0,
  rms_norm_eps=1e-5,
  tie_embeddings=False,
  max_position_embeddings=8192,
)
# By name, for what needs an architecture without its weights (`infer.profile_round
# --target=random:NAME`).
ARCHITECTURES = {
  "smollm2_135m": SMOLLM2_135M,
  "llama2_7b": LLAMA2_7B,
  "llama2_13b": LLAMA2_13B,
  "vicuna_7b": VICUNA_7B,
  "vicuna_13b": VICUNA_13B,
  "llama3_8b": LLAMA3_8B,
}


def platform(hardware: str) -> str:
  """The JAX platform of a hardware preset: cpu, gpu or tpu."""
  return "cpu" if hardware == "cpu" else "gpu" if hardware.startswith("gpu") else "tpu"


def not_this_host(devices: int, platform_name: str) -> str | None:
  """Why this host cannot compile programs for `devices` devices of `platform_name` (None
  when it can): a compiled program's memory analysis is only meaningful on its hardware."""
  import jax

  have = jax.devices()
  if (len(have), have[0].platform) == (devices, platform_name):
    return None
  return (
    f"compiled memory analysis: not run here ({len(have)} {have[0].platform} device(s), the "
    f"plan is for {devices} {platform_name}); run --dry_run on that hardware"
  )
