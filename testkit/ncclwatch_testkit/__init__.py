"""ncclwatch's test kit: the test and benchmark support that product code never imports.

- :mod:`ncclwatch_testkit.services`: the local services harness (Kafka, Prometheus,
  Alertmanager started by ``scripts/services.sh``; ``ensure_started``, ``WebhookReceiver``,
  ``TcpGate``, ``PrivateKafka``, ``RECORDED_TOPICS_ENV``, ...);
- :mod:`ncclwatch_testkit.scenarios`: labelled synthetic window and throughput streams
  (``python -m ncclwatch_testkit.scenarios``, docs/scenarios.md);
- :mod:`ncclwatch_testkit.synth`: synthetic op spools in the plugin's layout;
- :mod:`ncclwatch_testkit.demo`: a demo recording for the dashboards and reports
  (``python -m ncclwatch_testkit.demo``).

It is its own distribution (``ncclwatch-testkit``, ``testkit/pyproject.toml``), installed
into the project's venv by ``scripts/setup.sh``; it is not shipped with ncclwatch (not in
its wheel, sdist or container image).
"""
