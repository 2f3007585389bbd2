"""GPU agent: samples every GPU on a node each tick and publishes one `NodeTick` to Kafka.

`backend` is the small interface a tick needs from a GPU source; `nvml_backend` is the real
one over pynvml, `sim_backend` a deterministic simulated node for tests and demos;
`gpu_agent` builds and schedules ticks; `publisher` puts them on Kafka."""
