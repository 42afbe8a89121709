"""Render the cell_nat role's egress proxy configuration (squid) as Ansible
does, from the data chv.fleet.cell_nat_info returns (egress_names.plan)."""

from pathlib import Path

import jinja2

from testpaths import ROOT

SQUID_TEMPLATE = Path(ROOT) / "roles" / "cell_nat" / "templates" / "egress-proxy.conf.j2"


def render_proxy(proxy, log="/var/log/chv-egress-proxy/access.log", pid="/run/chv-egress-proxy/squid.pid",
                 cache_log="/var/log/chv-egress-proxy/cache.log"):
    """squid.conf for ``proxy`` (trim_blocks, strict undefined, as the role's template lookup)."""
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.from_string(SQUID_TEMPLATE.read_text()).render(
        __cell_nat_proxy=proxy, __cell_nat_proxy_log=log, __cell_nat_proxy_pid=pid,
        __cell_nat_proxy_cache_log=cache_log)
