"""``build_engine(config)``: the one way ``LLM`` and the server get an engine.

With ``tensor_parallel_size > 1`` it starts (or, under torchrun, joins) the other ranks first
(:mod:`portattn.engine.parallel.driver`), then builds rank 0's :class:`Engine` over them. The
orchestration sits here, above the engine: :mod:`portattn.engine.engine` imports nothing of
:mod:`portattn.engine.parallel`, whose worker builds the other ranks' engines.
"""

from __future__ import annotations

from .config import EngineConfig
from .engine import Engine


def build_engine(config: EngineConfig) -> Engine:
    """The engine for ``config``; under tensor parallelism, rank 0's, with the other ranks started.

    On a torchrun rank other than 0 this serves rank 0's steps and then raises ``SystemExit(0)``.
    If building fails, the ranks started are stopped before the error propagates.
    """
    if config.tensor_parallel_size == 1:
        return Engine(config)
    from .parallel.driver import start

    driver = start(config)  # on a torchrun rank other than 0: serves, then SystemExit
    try:
        return Engine(driver.config, tp=driver.tp, parallel=driver)
    except BaseException as err:
        driver.error = err
        driver.shutdown()
        raise
