"""Dump a domain's allow rules from a binary SELinux policy, expanded to single permissions.

Run with Debian's /usr/bin/python3 (setools is importable only there), never imported by pytest:

    /usr/bin/python3 policy_rules.py POLICY DOMAIN [DOMAIN ...]

Prints one JSON object: {domain: [[target, class, perm, condition], ...]}. Attributes are expanded
on both sides; a target equal to the queried domain reads "SELF", so two domains can be compared
rule for rule. condition is "" for an unconditional rule, else the boolean expression and the branch
("container_use_devices:True").
"""

import json
import sys

import setools


def rules_for(policy, domain):
    found = set()
    for rule in setools.TERuleQuery(policy, ruletype=["allow"], source=domain, source_indirect=True).results():
        if rule.extended:
            continue
        try:
            condition = f"{rule.conditional}:{rule.conditional_block}"
        except setools.exception.RuleNotConditional:
            condition = ""
        targets = [str(t) for t in rule.target.expand()]
        for target in targets:
            name = "SELF" if target == domain else target
            for perm in rule.perms:
                found.add((name, str(rule.tclass), str(perm), condition))
    return sorted(found)


def main(argv):
    policy = setools.SELinuxPolicy(argv[1])
    json.dump({domain: rules_for(policy, domain) for domain in argv[2:]}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
