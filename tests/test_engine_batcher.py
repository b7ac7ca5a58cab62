"""The batcher on the in-process engine: a request arriving while a wave decodes joins it (continuous
batching) and is answered before the wave's long request ends, as it would be alone; with waves only it
waits for the next wave."""
import time

import pytest

from hf_reference import small_model
from orthon.engine.batcher import ContinuousBatcher, Pending
from orthon.engine.in_process import InProcessEngine
from orthon.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("continuous", [True, False])
def test_a_late_request_joins_the_running_wave_only_when_continuous(continuous):
    engine = InProcessEngine(small_model("moe").eval())
    batcher = ContinuousBatcher(engine, continuous=continuous)
    try:
        long = Pending([5, 6, 7], SamplingParams(max_new_tokens=400, temperature=0.0, stop_token_ids=()), "long")
        batcher.submit([long])
        while not batcher.snapshot()["running"]:
            time.sleep(0.002)
        short = Pending([9, 8], SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=()), "short")
        batcher.submit([short])
        result = short.future.result(120)
        assert long.future.done() is not continuous  # answered while the long one still decoded, or after it
        long.future.result(120)
        snapshot = batcher.snapshot()
        assert (snapshot["generate_calls"], snapshot["joined"]) == ((1, 1) if continuous else (2, 0))
        alone = engine.generate([[9, 8]], SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=()))[0]
        assert result.tokens == alone.tokens
    finally:
        batcher.close()
