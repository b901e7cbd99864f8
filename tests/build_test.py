"""`train.build`: `train.init_from` is checked before anything loads (`distill_test.py` trains
from it end to end)."""

import pytest

from configs import llama2_7b, smollm2_135m
from pspec_jax.drafter_files import shipped_drafter
from train import build


def _smoke(init_from):
  config = smollm2_135m.get_config("smoke")
  config.train.init_from = init_from
  return config


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(num_draft=3), "has num_draft=4, the config's drafter 3"),
    (dict(draft_vocab_size=8192), "has draft_vocab_size=16384, the config's drafter 8192"),
    (dict(kind="eagle", init_from=shipped_drafter("smollm2-135m-instruct", "pspec")), "kind"),
  ],
)
def test_a_drafter_of_another_shape_is_one_clear_error(changes, message):
  config = _smoke(changes.pop("init_from", "shipped"))
  config.drafter.update(changes)
  with pytest.raises(ValueError, match="train.init_from: the drafter in .*" + message):
    build.init_from(config, build.step_config(config).target)


def test_a_missing_drafter_is_one_clear_error_and_a_matching_one_is_taken(tmp_path):
  config = _smoke(str(tmp_path))
  target = build.step_config(config).target
  with pytest.raises(ValueError, match="train.init_from: drafter not found: .*drafter.json"):
    build.init_from(config, target)
  config.train.init_from = ""
  assert build.init_from(config, target) is None
  config.train.init_from = "shipped"
  assert build.init_from(config, target) == shipped_drafter(target.name, "pspec")
  config = llama2_7b.get_config()
  config.train.init_from = "shipped"
  with pytest.raises(ValueError, match="init_from=shipped: no pspec drafter ships for"):
    build.init_from(config, build.step_config(config).target)
