"""specdec: lossless speculative decoding.

    import specdec
    llm = specdec.LLM(model="smollm2-135m", speculative_config={"draft": "smollm2-135m"})
    out = llm.generate(["Write a haiku"], specdec.SamplingParams(temperature=0))
"""

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError


def __getattr__(name):  # keep `import specdec` cheap: the engine pulls in torch models lazily
    if name == "LLM":
        from specdec.api import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "SpecdecError"]
