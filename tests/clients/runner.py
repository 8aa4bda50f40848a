"""The command line both client-check scripts share: `SCRIPT BASE_URL [CHECK ...]`.

Runs each named check (all by default) against the server at BASE_URL, one
line per check, then "N of M client checks passed"; returns non-zero if any
failed.
"""

import sys
import traceback


def run(doc, checks, configure):
    """`configure(base, model)` points the script's checks at the server."""
    if len(sys.argv) < 2:
        print(doc)
        return 2
    base = sys.argv[1].rstrip("/")
    names = sys.argv[2:] or list(checks)
    from openai import OpenAI

    configure(base, OpenAI(base_url=base, api_key="unused").models.list().data[0].id)
    failed = []
    for name in names:
        try:
            detail = checks[name]()
            print(f"ok   {name}: {detail}", flush=True)
        except Exception:
            failed.append(name)
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(names) - len(failed)} of {len(names)} client checks passed")
    return 1 if failed else 0
