"""Building the drafter of `--speculative-config` at engine start-up (checked against the
target model; a draft that does not fit is a ValueError naming what does not fit)."""

from __future__ import annotations

import logging

from k2serve.engine.spec_decode.config import SpeculativeConfig
from k2serve.engine.spec_decode.drafter import Drafter

logger = logging.getLogger(__name__)


def build_drafter(spec: SpeculativeConfig, engine) -> Drafter:
    """The drafter for `engine` (an LLMEngine whose model, runner and max_model_len are set)."""
    eagle = None
    if spec.method == "eagle3":
        from k2serve.engine.spec_decode.eagle import EagleProposer

        eagle = EagleProposer.load(spec, engine)
    drafter = Drafter(spec, engine.max_model_len, eagle=eagle)
    logger.info("%s", spec.describe())
    return drafter
