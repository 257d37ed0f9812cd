"""`python -m labtools.hosts`: the lab's modules across separate network hosts, on one machine.

Loopback hides whole classes of bugs: a server bound to 127.0.0.1, a hard-coded localhost, an
address that differs per host, a peer that advertises the wrong interface, a refused connection.
Here each host is a network namespace: a network stack of its own (its own loopback, no route to
the others' loopbacks), one interface (`eth0`) with its own address on a bridge that joins the
hosts, and its own HOME, model cache, temporary and run folders (namespaces share the filesystem;
separate HOMEs keep "the model is missing on host B" visible). A host's link can be capped with
`tc tbf` (`--rate`). Roles run as users run them, the commands of docs/two_machines.md
(`python -m <module> role=... cluster=hosts`), with a `conf/cluster/hosts.yaml` of their own
that names the hosts' addresses, a shared secret, and TLS for the netproto modules (`--tls`).

    python -m labtools.hosts check           # every registered module across hosts, vs loopback
    python -m labtools.hosts check --tls --rate 100mbit --only spec_decoding

`check` prints one line per module and ends with `modules identical across hosts: N of M`; each
role's log, metrics and outputs are kept under `--out`. Everything the harness made (namespaces,
bridge, processes) is removed on the way out, after a failure or Ctrl-C too, and namespaces left
by a harness killed outright (SIGKILL) are removed by the next one. It needs root and iproute2;
without them it says why and does nothing.

    python -m labtools.hosts link            # the emulated link itself: round trip, TCP rate
    python -m labtools.hosts faults --tls    # fed_learn with a client, then the coordinator, killed
    python -m labtools.hosts curves          # each module over delay x rate, vs its cost model

Link delay: netem is missing on the lab's machines (and tbf's `latency` only bounds a queue), so
`Network(delay_ms=...)` makes the switch a router that sends every packet between hosts through
a TUN device, where `labtools.linkdelay` holds it for the delay: TensorPipe's traffic as well as
netproto's. What the namespaces do not model: cores (every host shares this machine's CPUs).

The package, by job: `network` (the namespaces, the bridge, the links), `scenarios` (an
experiment's roles across hosts and on loopback, and `check`), `faults`, `exposure` (a stranger's
attacks), `curves`, `probe` (the link itself), `documented` (the docs' multi-machine commands) and
`cli`. Every experiment-specific part (its roles, settings, faults, comparisons) is its
manifest's (lab.registry).
"""

from __future__ import annotations

from labtools.hosts.cli import (
    main,
)
from labtools.hosts.curves import (
    CURVE_DELAYS_MS,
    CURVE_RATES,
    curves,
)
from labtools.hosts.documented import (
    DOC_SERVER,
    DOCUMENTED,
    Documented,
    documented_runs,
    run_documented,
)
from labtools.hosts.exposure import (
    ATTACKS,
    DIAL_ALL,
    OVERLAY_PREFIX,
    STRANGER,
    Exposure,
    Listener,
    exposed,
    listeners,
    probe_exposure,
)
from labtools.hosts.faults import (
    check_fault,
    fault_names,
    faults,
)
from labtools.hosts.network import (
    BRIDGE,
    CLUSTER_NAME,
    NOT_INHERITED,
    PREFIX,
    ROOT,
    ROUTE_TABLE,
    SUBNET,
    TUN,
    Host,
    HostsError,
    Network,
    remove_stale,
    unavailable,
)
from labtools.hosts.probe import (
    PROBE_PORT,
    link,
    measure_link,
)
from labtools.hosts.scenarios import (
    Inject,
    Outcome,
    Roles,
    Security,
    check,
    check_module,
    make_certificate,
    modules,
    provision,
    run_across,
    run_loopback,
    scenarios,
    write_cluster,
)

__all__ = [
    "ATTACKS",
    "BRIDGE",
    "CLUSTER_NAME",
    "CURVE_DELAYS_MS",
    "CURVE_RATES",
    "DIAL_ALL",
    "DOCUMENTED",
    "DOC_SERVER",
    "NOT_INHERITED",
    "OVERLAY_PREFIX",
    "PREFIX",
    "PROBE_PORT",
    "ROOT",
    "ROUTE_TABLE",
    "STRANGER",
    "SUBNET",
    "TUN",
    "Documented",
    "Exposure",
    "Host",
    "HostsError",
    "Inject",
    "Listener",
    "Network",
    "Outcome",
    "Roles",
    "Security",
    "check",
    "check_fault",
    "check_module",
    "curves",
    "documented_runs",
    "exposed",
    "fault_names",
    "faults",
    "link",
    "listeners",
    "main",
    "make_certificate",
    "measure_link",
    "modules",
    "probe_exposure",
    "provision",
    "remove_stale",
    "run_across",
    "run_documented",
    "run_loopback",
    "scenarios",
    "unavailable",
    "write_cluster",
]
