import pytest
from hypothesis import given
from hypothesis import strategies as st

from chv_guest.cell import resolver

STUB = "# managed by resolved\nnameserver 127.0.0.53\noptions edns0 trust-ad\nsearch lan\n"
UPSTREAM = "nameserver 192.0.2.10\nnameserver 2001:db8::53\nsearch corp.example lan\n"


def test_plain_host_resolvers_used():
    assert resolver.effective_upstream("nameserver 10.255.255.53\n") == (["10.255.255.53"], [])


def test_stub_replaced_by_resolved_upstream():
    servers, search = resolver.effective_upstream(STUB, UPSTREAM)
    assert servers == ["192.0.2.10", "2001:db8::53"]
    assert search == ["corp.example", "lan"]


def test_stub_without_upstream_fails_clearly():
    with pytest.raises(resolver.ResolverError) as e:
        resolver.effective_upstream(STUB, None)
    assert "127.0.0.53" in str(e.value) and "dns_servers" in str(e.value)


def test_upstream_file_listing_only_loopback_fails():
    with pytest.raises(resolver.ResolverError):
        resolver.effective_upstream(STUB, "nameserver 127.0.0.1\nnameserver ::1\n")


def test_mixed_keeps_only_non_loopback():
    servers, dummy = resolver.effective_upstream("nameserver 127.0.0.1\nnameserver 198.51.100.1\n", UPSTREAM)
    assert servers == ["198.51.100.1"]


def test_override_wins_and_keeps_host_search():
    servers, search = resolver.effective_upstream(STUB, UPSTREAM, override=["9.9.9.9"])
    assert servers == ["9.9.9.9"] and search == ["lan"]


def test_override_loopback_refused():
    with pytest.raises(resolver.ResolverError):
        resolver.effective_upstream(None, None, override=["127.0.0.53"])


def test_link_local_and_zone_ids_dropped():
    servers, dummy = resolver.effective_upstream("nameserver fe80::1%eth0\nnameserver 203.0.113.5\n")
    assert servers == ["203.0.113.5"]


def test_comments_garbage_and_limit_three():
    text = "nameserver 1.1.1.1 # c\n; x\nnameserver nonsense\nnameserver 1.0.0.1\nnameserver 8.8.8.8\nnameserver 8.8.4.4\n"
    servers, dummy = resolver.effective_upstream(text)
    assert servers == ["1.1.1.1", "1.0.0.1", "8.8.8.8"]


def test_render_files():
    txt = resolver.render_resolv_conf(["192.0.2.10"], ["lan"])
    assert "nameserver 192.0.2.10\n" in txt and "search lan\n" in txt
    hosts = resolver.render_hosts("chv-slot0", "10.200.0.2")
    assert "10.200.0.2\tchv-slot0\n" in hosts and "127.0.0.1\tlocalhost" in hosts


ips = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str)


@given(st.lists(ips, min_size=0, max_size=6), st.lists(ips, min_size=0, max_size=6))
def test_never_hands_out_loopback(host, upstream):
    host_text = "".join("nameserver %s\n" % a for a in host)
    up_text = "".join("nameserver %s\n" % a for a in upstream)
    try:
        servers, dummy = resolver.effective_upstream(host_text, up_text)
    except resolver.ResolverError:
        return
    import ipaddress

    assert 1 <= len(servers) <= 3
    for s in servers:
        ip = ipaddress.ip_address(s)
        assert not ip.is_loopback and not ip.is_unspecified and not ip.is_link_local
