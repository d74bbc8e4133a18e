"""The operator's tools: the kubectl plugin, inspect, install, the chart schema, metrics."""
