"""Test and benchmark harness, beside the package and not installed with it: real processes
on loopback (sim workers, gateways, the EPP, Envoy: launch.py) and a real DNS server
(dnsmasq.py). tests/ and bench/ import it from the repository root."""
