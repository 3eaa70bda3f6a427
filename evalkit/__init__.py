"""What tests, benchmarks and scripts share and the product does not ship:
the development data, the comparisons of engine outputs, probes run
inside engines, the markdown tables of the benchmarks, and waiting for a
server under test."""
