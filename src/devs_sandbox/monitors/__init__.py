"""Monitors are policies: pure ``check(sample) -> verdict`` over samples the lifecycle's
watchdog collects. Nothing here performs I/O, kills or publishes (an import-linter
contract keeps it so): ``drain`` for a sandbox's quotas, ``usage`` for a monitored
command's memory and CPU."""
