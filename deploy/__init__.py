"""hbmd's deployment files, shipped with the package so that installing its wheel is enough to deploy it.

Beside this module: ``hbmd@.service`` (the systemd unit), ``hbmd.sysusers.conf``,
``grafana-dashboard.json``, ``hbmd-daemonset.yaml`` and ``README.md``, which
says how to install them. ``python -m hbmd.deploy`` prints the directory
that holds them; ``python -m hbmd.deploy.daemonset --gpus N`` writes the
Kubernetes manifests for nodes with N GPUs.
"""
