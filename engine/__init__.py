"""orthon.engine: generation behind one protocol (``Engine``), the in-process engine and its fused
decode runner. Layer: above pretrain (the model), below midtrain, rl and launch."""
from orthon.engine.in_process import EngineConfig, InProcessEngine
from orthon.engine.protocol import Engine, FinishReason, GenerationResult, WeightDelta, WeightsSource
from orthon.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerationResult", "InProcessEngine", "SamplingParams",
           "WeightDelta", "WeightsSource"]
