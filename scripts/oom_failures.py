"""Prints the node ids of a junit XML's failed tests, space-separated, if every failure was a CUDA out-of-memory
error (else nothing): gpu_run.sh's tests step reruns those on fewer workers (a 78 GiB H100 under 16 workers)."""
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
    failed = []
    for case in ET.parse(path).iter("testcase"):
        bad = case.findall("failure") + case.findall("error")
        if bad:
            text = " ".join((f.get("message") or "") + (f.text or "") for f in bad)
            failed.append((case.get("classname", ""), case.get("name", ""), text))
    if failed and all("OutOfMemoryError" in text for _, _, text in failed):
        print(" ".join(cls.replace(".", "/") + ".py::" + name for cls, name, _ in failed))


if __name__ == "__main__":
    main(sys.argv[1])
