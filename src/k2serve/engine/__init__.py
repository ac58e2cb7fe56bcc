"""The engine: requests, sampling, continuous-batching scheduler, model runner, sync and async
engines and the offline `LLM` API. Start reading at `engine.py`."""
