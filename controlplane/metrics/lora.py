"""LoRA metrics (--enable-lora), vLLM's names with the kvloom_ prefix.

kvloom_lora_requests_info is vLLM's lora_requests_info: one series whose
labels carry --max-loras and the adapters with running and waiting requests
(comma-joined names, in vLLM's order of fields), and whose value is when it
was read, so a dashboard can take the latest. Beside it, per adapter:
finished requests and the prompt and generated tokens they carried.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from controlplane.core.outputs import EngineCoreOutput
from controlplane.core.sched_stats import SchedulerStats


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name", "lora_name"]
        self.model_name = model_name
        self.finished = Counter("kvloom_lora_requests", "Finished requests per LoRA adapter.",
                                labels, registry=registry)
        self.prompt_tokens = Counter("kvloom_lora_prompt_tokens", "Prompt tokens of finished "
                                     "requests per LoRA adapter.", labels, registry=registry)
        self.generation_tokens = Counter("kvloom_lora_generation_tokens", "Tokens generated "
                                         "per LoRA adapter.", labels, registry=registry)

    def observe(self, outputs: Iterable[EngineCoreOutput]) -> None:
        m = self.model_name
        for out in outputs:
            name = out.lora_name
            if not name:
                continue
            if out.new_token_ids:
                self.generation_tokens.labels(m, name).inc(len(out.new_token_ids))
            if out.finished:
                self.finished.labels(m, name).inc()
                self.prompt_tokens.labels(m, name).inc(out.num_prompt_tokens)


def lora_requests_info(stats: SchedulerStats | None, model_name: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily("kvloom_lora_requests_info", "Running and waiting LoRA adapters "
                          "(names, comma-joined) and --max-loras; the value is when it was "
                          "read (Unix seconds).",
                          labels=["model_name", "max_lora", "waiting_lora_adapters",
                                  "running_lora_adapters"])
    waiting = ",".join(name for name, _ in stats.waiting_lora_adapters) if stats else ""
    running = ",".join(name for name, _ in stats.running_lora_adapters) if stats else ""
    g.add_metric([model_name, str(stats.max_loras if stats else 0), waiting, running],
                 time.time())
    return g
