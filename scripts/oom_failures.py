"""Prints the node ids of a junit XML's failed tests that failed with a CUDA out-of-memory error, space-separated
(nothing if none did): gpu_run.sh's tests step reruns those on fewer workers (a 78 GiB H100 under 16 workers).
Exit status 1 when other failures are present too (they stand whatever the rerun gives)."""
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
    failed = []
    for case in ET.parse(path).iter("testcase"):
        bad = case.findall("failure") + case.findall("error")
        if bad:
            text = " ".join((f.get("message") or "") + (f.text or "") for f in bad)
            failed.append((case.get("classname", ""), case.get("name", ""), text))
    oom = [cls.replace(".", "/") + ".py::" + name for cls, name, text in failed if "OutOfMemoryError" in text]
    if oom:
        print(" ".join(oom))
    return 1 if len(oom) < len(failed) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
