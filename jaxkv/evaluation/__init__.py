"""Evaluation on the benchmarks' side: replaying traced sessions through the serving
engine (teacher-forced or free turns, many sessions batched) and the metrics read
from what the engine did. Serving never imports this package."""
