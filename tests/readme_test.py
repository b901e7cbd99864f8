"""The README's Python code blocks run as written, one after another, in one namespace.

A block that names a checkpoint the reader must supply (`path/to/...`) is left out: it needs
files this checkout does not have.
"""

import os
import re

import numpy as np
import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks() -> list[str]:
  with open(README) as fh:
    text = fh.read()
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_the_library_snippets():
  blocks = python_blocks()
  assert len(blocks) >= 2
  # The shipped drafter is named, not a placeholder path.
  assert any('resolve_drafter("pspec", None, target)' in b for b in blocks)
  # The speculative call decodes with the plain call's settings (EOS included).
  assert any("eos_ids=pj.eos_token_ids(" in b for b in blocks)
  # The examples use the curated surface (`import pspec_jax as pj`).
  assert "import pspec_jax as pj" in blocks[0]


@pytest.mark.slow
def test_the_readme_python_blocks_run_as_written(capsys):
  runnable = [b for b in python_blocks() if "path/to/" not in b]
  assert len(runnable) >= 2
  namespace = {}
  outputs = []
  for block in runnable:
    exec(compile(block, README, "exec"), namespace)  # noqa: S102 - the README's own code
    outputs.append(capsys.readouterr().out)
  plain, speculative = outputs[0], outputs[1]
  # The speculative call prints plain decoding's reply first (the same tokens), then its stats.
  assert plain.strip() and speculative.startswith(plain)
  # The reply to "Hi!" ends at the end of its turn (an EOS id), well within the budget: the
  # text does not run on into an invented next turn.
  out, cfg = namespace["out"], namespace["cfg"]
  length = int(out.lengths[0])
  assert length < cfg.max_new_tokens and int(out.tokens[0, length - 1]) in cfg.eos_ids
  assert (np.asarray(out.tau) >= 1).all()
