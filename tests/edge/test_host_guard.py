"""The edge agent refuses what a web page could make a browser on the device's network send (issue 47, row 8).

A device runs in a network namespace of its own and is reached by its address, as `pkg push` reaches it; that
address is the name it is bound to, so it is served. A name a page could rebind to the device (`evil.example`) is
a 403 on the agent's routes and on the bundle's `/v1` (no key by default), and a cross-site form body a 415.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.edge.conftest import TOKEN, Device

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_device_is_served_by_its_address_and_local_names_only(devices: Callable[..., list[Device]]) -> None:
    (device,) = devices(1, ["--allowed-host", "jetson-7.fleet.example.com"])
    assert device.status()["health"] == "empty"  # reached by its address: served
    for host in ("evil.example", "evil.example:8470", f"{device.address}.nip.io"):
        for method, path in (("GET", "/agent/status"), ("GET", "/v1/models"), ("PUT", "/agent/adapters/x")):
            response = httpx.request(method, device.url + path, headers={**AUTH, "Host": host}, timeout=10)
            assert response.status_code == 403, (host, path, response.text)
            assert response.json()["error"]["code"] == "host_not_allowed"
    for host in ("jetson-7.local", "jetson-7", "jetson-7.fleet.example.com", f"{device.address}:8470"):
        response = httpx.get(device.url + "/agent/status", headers={**AUTH, "Host": host}, timeout=10)
        assert response.status_code == 200, (host, response.text)
    form = httpx.put(
        device.url + "/agent/adapters/x",
        content=b"a=b",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    origin = httpx.get(device.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert origin.status_code == 403 and origin.json()["error"]["code"] == "cross_origin_request"
