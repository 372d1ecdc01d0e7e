import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from oci_gpu_hook.errors import RequestError, RequirementError
from oci_gpu_hook.start import driver
from oci_gpu_hook.start.requirements import (
    CUDA_HINT,
    MAX_TERMS,
    MAX_VALUE_LENGTH,
    MAX_VARIABLES,
    GpuFacts,
    Requirements,
    legacy_cuda_requirement,
    parse_bool,
    parse_requirements,
)

# A CUDA 12.4.1 image's NVIDIA_REQUIRE_CUDA, as published (91 terms).
_BRANDS_12 = ("tesla", "unknown", "nvidia", "nvidiartx", "geforce", "geforcertx", "quadro", "quadrortx", "titan")
CUDA_12_4 = "cuda>=12.4 " + " ".join(
    f"brand={b},driver>={d},driver<{d + 1}" for d in (470, 525, 535) for b in (*_BRANDS_12, "titanrtx")
)

A100 = GpuFacts(cuda="12.4", driver="550.54.15", arch="8.0", brand="Tesla")
OLD_GEFORCE = GpuFacts(cuda="12.2", driver="535.104.05", arch="8.6", brand="GeForce")
OLD_TESLA = GpuFacts(cuda="12.2", driver="535.104.05", arch="8.0", brand="Tesla")
NO_GPU = GpuFacts(cuda="12.2", driver="535.104.05")
UNKNOWN = GpuFacts(cuda=None, driver=None)


def reqs(value, name="NVIDIA_REQUIRE_CUDA"):
    return parse_requirements({name: value})


def message(value, facts, name="NVIDIA_REQUIRE_CUDA"):
    with pytest.raises(RequirementError) as e:
        reqs(value, name).check(facts)
    return e.value.message


# --- which variables ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "   ", "\t", ",", " , ,, "])
def test_empty_value_is_no_requirement(value):
    r = reqs(value)
    assert not r and r.describe() == "none"
    r.check(OLD_GEFORCE)


def test_no_variables_is_no_requirement():
    r = parse_requirements({"PATH": "/bin", "NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VERSION": "99.0"})
    assert r == Requirements() and r.describe() == "none"


def test_every_nvidia_require_variable_applies_and_all_must_hold():
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=12.0", "NVIDIA_REQUIRE_ARCH": "arch>=9.0", "NVIDIA_REQUIRE_": "driver>=1"}
    r = parse_requirements(env)
    assert [q.variable for q in r.requirements] == ["NVIDIA_REQUIRE_", "NVIDIA_REQUIRE_ARCH", "NVIDIA_REQUIRE_CUDA"]
    with pytest.raises(RequirementError, match=r"^unsatisfied condition: arch>=9.0$"):
        r.check(A100)
    r.check(GpuFacts(cuda="12.4", driver="550.54.15", arch="9.0", brand="Tesla"))


@pytest.mark.parametrize("name", ["NVIDIA_REQUIRE_JETPACK", "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS"])
def test_jetpack_variables_are_ignored_like_nvidia(name):
    assert not parse_requirements({name: "csv-mounts=all"})


@pytest.mark.parametrize("name", ["nvidia_require_cuda", "XNVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRED"])
def test_other_names_are_ignored(name):
    assert not parse_requirements({name: "nonsense"})


def test_variables_are_checked_in_name_order():
    env = {"NVIDIA_REQUIRE_Z": "arch>=99.0", "NVIDIA_REQUIRE_A": "cuda>=99.0"}
    with pytest.raises(RequirementError, match="cuda>=99.0"):
        parse_requirements(env).check(A100)


# --- syntax ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, satisfied",
    [
        ("cuda>=12.4", True),
        ("cuda>12.4", False),
        ("cuda=12.4", True),
        ("cuda=12.4.0", True),  # missing fields count as 0
        ("cuda!=12.4", False),
        ("cuda<12.5", True),
        ("cuda<=12.3", False),
        ("cuda>=12", True),
        ("cuda<13", True),
        ("CUDA>=12.4", True),  # keys are case-insensitive
        ("Driver>=550", True),
        ("driver>=384", True),
        ("driver>=550.54.15", True),
        ("driver>550.54.15", False),
        ("driver<550.54.16", True),
        ("driver>=550.54.015", True),  # fields compare as numbers
        ("driver<550.100", True),  # 54 < 100, not a string comparison
        ("driver=550.54.15.0", True),
        ("arch>=8.0", True),
        ("arch>=8", True),
        ("arch<8.6", True),
        ("arch=9.0", False),
        ("brand=tesla", True),
        ("brand=TESLA", True),
        ("BRAND=Tesla", True),
        ("brand!=tesla", False),
        ("brand=geforce", False),
        ("brand!=geforce", True),
        ("brand=someday-new-brand", False),  # an unknown brand is never equal
        ("cuda>=12.0,driver>=550,arch>=8.0,brand=tesla", True),  # AND
        ("cuda>=12.0,arch>=9.0", False),
        ("cuda>=13.0 arch>=8.0", True),  # OR
        ("cuda>=13.0 arch>=9.0", False),
        ("  cuda>=13.0\t\tarch>=8.0  ", True),  # any ASCII whitespace separates alternatives
        (",cuda>=12.4,,", True),  # empty terms are skipped
        ("cuda>=13.0 ,", False),  # an alternative with no term is skipped, not taken as true
    ],
)
def test_terms_are_evaluated_against_the_gpu(value, satisfied):
    r = reqs(value)
    if satisfied:
        r.check(A100)
    else:
        with pytest.raises(RequirementError):
            r.check(A100)


def test_real_cuda_image_value_parses_and_checks():
    r = reqs(CUDA_12_4)
    assert sum(len(a) for a in r.requirements[0].alternatives) == 91
    r.check(A100)  # new enough CUDA
    r.check(OLD_TESLA)  # an older CUDA, but a data-centre brand on a branch with forward compatibility
    assert message(CUDA_12_4, GpuFacts("12.2", "530.30.02", "8.6", "GeForce")) == (
        "unsatisfied condition: cuda>=12.4" + CUDA_HINT
    )


@pytest.mark.parametrize(
    "value, problem, accepted",
    [
        ("cuda==12.4", "unknown operator '=='", "= != < <= > >="),
        ("cuda=>12.4", "unknown operator '=>'", "= != < <= > >="),
        ("cuda>=<12.4", "unknown operator '>=<'", "= != < <= > >="),
        ("cuda~12.4", "'cuda~12.4' has no operator", "KEY OP VALUE"),
        ("cuda", "'cuda' has no operator", "KEY OP VALUE"),
        (">=12.4", "'>=12.4' has no key", "KEY OP VALUE"),
        ("cuda>=", "'cuda>=' has no value", "a CUDA version such as 12.4"),
        ("gpu>=1", "unknown key 'gpu' in 'gpu>=1'", "cuda, driver, arch, brand"),
        ("compute>=8.0", "unknown key 'compute'", "cuda, driver, arch, brand"),
        ("csv-mounts=all", "unknown key 'csv-mounts'", "cuda, driver, arch, brand"),
        ("cuda>=12.x", "'12.x' in 'cuda>=12.x' is not a version", "a CUDA version such as 12.4"),
        ("cuda>=v12.4", "'v12.4' in 'cuda>=v12.4' is not a version", "a CUDA version"),
        ("cuda>=12..4", "is not a version", "a CUDA version"),
        ("cuda>=.4", "is not a version", "a CUDA version"),
        ("cuda>=12.4.", "is not a version", "a CUDA version"),
        ("cuda>=1.2.3.4.5", "is not a version", "a CUDA version"),
        ("cuda>=1234567890", "is not a version", "a CUDA version"),
        ("cuda>=\u0661\u0662", "is not a version", "a CUDA version"),  # Arabic-Indic digits are not digits here
        ("driver>=535.104.05-1", "is not a version", "a driver version such as 535 or 535.104.05"),
        ("arch>=sm_80", "'sm_80' in 'arch>=sm_80' is not a version", "a compute capability such as 8.0"),
        ("arch>=8.0+PTX", "is not a version", "a compute capability"),
        ("brand<tesla", "brand cannot be ordered: 'brand<tesla'", "brand=NAME or brand!=NAME"),
        ("brand>=tesla", "brand cannot be ordered", "brand=NAME or brand!=NAME"),
        (
            "brand=tes/la",
            "'tes/la' in 'brand=tes/la' is not a brand name",
            "an NVML brand name: unknown, quadro, tesla",
        ),
        ("brand=", "has no value", "an NVML brand name"),
        ("cuda>=12.4 arch>=sm_90", "'sm_90' in 'arch>=sm_90' is not a version", "a compute capability"),
    ],
)
def test_malformed_terms_are_request_errors_naming_variable_value_and_accepted(value, problem, accepted):
    with pytest.raises(RequestError) as e:
        reqs(value, "NVIDIA_REQUIRE_X")
    text = e.value.message
    assert not isinstance(e.value, RequirementError)
    assert text.startswith(f"NVIDIA_REQUIRE_X={value}: "), text
    assert problem in text and f"(accepted: {accepted}" in text, text


def test_every_known_brand_is_listed_as_accepted():
    with pytest.raises(RequestError) as e:
        reqs("brand=#")
    assert all(b.lower() in e.value.message for b in driver.BRANDS)


def test_unknown_key_with_non_ascii_case_is_rejected():
    with pytest.raises(RequestError, match="unknown key"):
        reqs("\u0130rch>=8.0")  # keys compare as ASCII only


def test_error_shows_non_printable_characters_escaped_and_long_values_cut():
    with pytest.raises(RequestError) as e:
        reqs("cuda>=1\x1b[31m " + "x" * 300)
    text = e.value.message
    assert "\x1b" not in text and "\\x1b" in text
    assert len(text) < 400 and "..." in text


# --- bounds ------------------------------------------------------------------------------------------


def test_a_value_longer_than_the_limit_is_refused():
    with pytest.raises(RequestError, match=rf"^NVIDIA_REQUIRE_CUDA: the value is longer than {MAX_VALUE_LENGTH}"):
        reqs("cuda>=1 " * (MAX_VALUE_LENGTH // 8 + 1))


def test_more_terms_than_the_limit_are_refused_before_any_is_parsed():
    value = ",".join(["arch=1"] * (MAX_TERMS + 1))
    assert len(value) <= MAX_VALUE_LENGTH
    with pytest.raises(RequestError, match=rf"more than {MAX_TERMS} terms"):
        reqs(value)
    with pytest.raises(RequestError, match=rf"more than {MAX_TERMS} terms"):
        reqs(",".join(["bad"] * (MAX_TERMS + 1)))


def test_terms_up_to_the_limit_are_accepted():
    assert reqs(",".join(["arch>=1"] * MAX_TERMS))


def test_more_variables_than_the_limit_are_refused():
    env = {f"NVIDIA_REQUIRE_{i}": "" for i in range(MAX_VARIABLES + 1)}
    with pytest.raises(RequestError, match=rf"more than {MAX_VARIABLES} NVIDIA_REQUIRE_"):
        parse_requirements(env)
    del env["NVIDIA_REQUIRE_0"]
    assert not parse_requirements(env)


# --- facts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["arch>=99.0", "arch<1.0", "brand=quadro", "brand!=unknown", "arch=1,brand=x"])
def test_arch_and_brand_terms_hold_with_no_gpu_selected(value):
    reqs(value).check(NO_GPU)


@pytest.mark.parametrize("value", ["cuda>=12.4", "driver>=550"])
def test_cuda_and_driver_terms_still_apply_with_no_gpu_selected(value):
    with pytest.raises(RequirementError):
        reqs(value).check(NO_GPU)


@pytest.mark.parametrize("value", ["cuda>=99.0", "driver>=999", "arch>=99.0", "brand=quadro", CUDA_12_4])
def test_unknown_facts_hold_like_nvidia(value):
    reqs(value).check(UNKNOWN)
    reqs(value).check(None)


def test_brand_unknown_is_a_real_nvml_brand():
    reqs("brand=unknown").check(GpuFacts(cuda="12.4", driver="550", arch="8.0", brand="Unknown"))
    with pytest.raises(RequirementError):
        reqs("brand=unknown").check(A100)


@pytest.mark.parametrize(
    "facts, fact_name",
    [
        (GpuFacts(cuda="twelve", driver="550"), "CUDA version"),
        (GpuFacts(cuda="12.4", driver="550.x"), "driver version"),
        (GpuFacts(cuda="12.4", driver="550", arch="sm_80"), "compute capability"),
    ],
)
def test_a_host_fact_that_is_not_a_version_fails_the_check(facts, fact_name):
    with pytest.raises(RequirementError, match=f"host's {fact_name}"):
        reqs("cuda>=1,driver>=1,arch>=1").check(facts)


def test_host_fact_with_surrounding_whitespace_is_read():
    reqs("driver>=550").check(GpuFacts(cuda="12.4", driver="550.54.15\n"))


# --- the failure message --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, facts, expected",
    [
        ("cuda>=12.4", OLD_GEFORCE, "unsatisfied condition: cuda>=12.4" + CUDA_HINT),
        ("cuda>12.2", OLD_GEFORCE, "unsatisfied condition: cuda>12.2" + CUDA_HINT),
        ("CUDA>=12.4", OLD_GEFORCE, "unsatisfied condition: CUDA>=12.4" + CUDA_HINT),  # as written
        ("cuda<12.0", OLD_GEFORCE, "unsatisfied condition: cuda<12.0"),  # a newer driver would not help
        ("cuda=12.4", OLD_GEFORCE, "unsatisfied condition: cuda=12.4"),
        ("brand=tesla", OLD_GEFORCE, "unsatisfied condition: brand=tesla"),
        ("arch>=9.0", OLD_GEFORCE, "unsatisfied condition: arch>=9.0"),
        ("driver>=550", OLD_GEFORCE, "unsatisfied condition: driver>=550"),
        # the first alternative, as NVIDIA prints it, with the hint only when its cuda term fails
        ("cuda>=12.0,brand=tesla", OLD_GEFORCE, "unsatisfied condition: cuda>=12.0,brand=tesla"),
        ("cuda>=12.4,brand=tesla", OLD_GEFORCE, "unsatisfied condition: cuda>=12.4,brand=tesla" + CUDA_HINT),
        ("brand=tesla,cuda>=12.4", OLD_GEFORCE, "unsatisfied condition: brand=tesla,cuda>=12.4" + CUDA_HINT),
        ("cuda>=12.4 brand=tesla,driver>=470,driver<471", OLD_GEFORCE, "unsatisfied condition: cuda>=12.4" + CUDA_HINT),
        ("arch>=9.0 cuda>=12.4", OLD_GEFORCE, "unsatisfied condition: arch>=9.0"),
        (",,cuda>=12.4,, brand=tesla", OLD_GEFORCE, "unsatisfied condition: cuda>=12.4" + CUDA_HINT),
    ],
)
def test_failure_message(value, facts, expected):
    assert message(value, facts) == expected


def test_the_message_users_know():
    assert message("cuda>=12.4", OLD_GEFORCE) == (
        "unsatisfied condition: cuda>=12.4, please update your driver to a newer version, "
        "or use an earlier cuda container"
    )


# --- describe ------------------------------------------------------------------------------------------


def test_describe_lists_variables_and_alternatives():
    env = {"NVIDIA_REQUIRE_CUDA": " cuda>=12.4  brand=tesla,,driver>=470 ", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}
    assert parse_requirements(env).describe() == (
        "NVIDIA_REQUIRE_ARCH: arch>=8.0; NVIDIA_REQUIRE_CUDA: cuda>=12.4 or brand=tesla,driver>=470"
    )


# --- legacy images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda_version, requirement",
    [
        ("10.2.89", "cuda>=10.2"),
        ("12.4.1", "cuda>=12.4"),
        ("12.4", "cuda>=12.4"),
        ("9.0.176", "cuda>=9.0"),
        ("12", "cuda>=12.0"),
        ("v11.8.0", "cuda>=11.8"),
        ("12.8.0.038", "cuda>=12.8"),  # NGC's four fields
        ("12.4.1-1", "cuda>=12.4"),
        ("12.4.1+build", "cuda>=12.4"),
        (" 12.4.1 ", "cuda>=12.4"),
        ("010.02", "cuda>=10.2"),
    ],
)
def test_legacy_cuda_version_becomes_a_cuda_requirement(cuda_version, requirement):
    assert legacy_cuda_requirement(cuda_version) == requirement
    assert reqs(requirement).describe() == f"NVIDIA_REQUIRE_CUDA: {requirement}"


@pytest.mark.parametrize("cuda_version", ["", "   ", "latest", "12.x", "1.2.3.4.5.6.7", "12 4", "\u0661\u0662.1", ".4"])
def test_legacy_cuda_version_that_is_not_a_version_is_a_request_error(cuda_version):
    with pytest.raises(RequestError, match=r"^CUDA_VERSION=.*: not a CUDA version \(accepted: MAJOR"):
        legacy_cuda_requirement(cuda_version)


# --- NVIDIA_DISABLE_REQUIRE ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "t", "T", "TRUE", "true", "True"])
def test_go_true_spellings_disable(value):
    assert parse_bool(value) is True


@pytest.mark.parametrize("value", ["0", "f", "F", "FALSE", "false", "False"])
def test_go_false_spellings_do_not_disable(value):
    assert parse_bool(value) is False


@pytest.mark.parametrize("value", [None, "", "yes", "on", "tRUE", " true", "true ", "2", "enabled"])
def test_unparsable_values_are_false_like_nvidia(value):
    assert parse_bool(value) is False


# --- properties ----------------------------------------------------------------------------------------

_term_texts = st.one_of(
    st.text(max_size=12),
    st.builds(
        lambda k, o, v: k + o + v,
        st.sampled_from(["cuda", "driver", "arch", "brand", "CUDA", "x", ""]),
        st.sampled_from(["=", "!=", "<", "<=", ">", ">=", "==", "=>", "!", ""]),
        st.one_of(st.from_regex(r"[0-9]{1,3}(\.[0-9]{1,3}){0,4}", fullmatch=True), st.sampled_from(driver.BRANDS)),
    ),
)
_values = st.one_of(
    st.text(max_size=64),
    st.lists(st.lists(_term_texts, max_size=4).map(",".join), max_size=4).map(" ".join),
)
_names = st.one_of(
    st.text(max_size=8), st.sampled_from(["CUDA", "ARCH", "X", "JETPACK", ""]).map("NVIDIA_REQUIRE_".__add__)
)
_facts = st.builds(
    GpuFacts,
    cuda=st.one_of(st.none(), st.text(max_size=8), st.from_regex(r"[0-9]{1,2}\.[0-9]", fullmatch=True)),
    driver=st.one_of(st.none(), st.text(max_size=8), st.from_regex(r"[0-9]{3}(\.[0-9]{2,3}){0,2}", fullmatch=True)),
    arch=st.one_of(st.none(), st.text(max_size=5), st.from_regex(r"[0-9]\.[0-9]", fullmatch=True)),
    brand=st.one_of(st.none(), st.text(max_size=8), st.sampled_from(driver.BRANDS)),
)


@hsettings(max_examples=400, deadline=None)
@given(st.dictionaries(_names, _values, max_size=6))
def test_parsing_any_environment_raises_only_request_errors(env):
    try:
        r = parse_requirements(env)
    except RequestError as e:
        assert "\n" not in e.message
        return
    assert isinstance(r.describe(), str)


@hsettings(max_examples=400, deadline=None)
@given(st.dictionaries(_names, _values, max_size=6), _facts)
def test_checking_any_facts_raises_only_requirement_errors(env, facts):
    try:
        r = parse_requirements(env)
    except RequestError:
        return
    try:
        r.check(facts)
    except RequirementError as e:
        assert e.message.startswith(("unsatisfied condition: ", "cannot check "))


@hsettings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_legacy_cuda_requirement_raises_only_request_errors_and_yields_a_valid_requirement(cuda_version):
    try:
        requirement = legacy_cuda_requirement(cuda_version)
    except RequestError:
        return
    assert reqs(requirement)


@hsettings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 999), min_size=1, max_size=4),
    st.lists(st.integers(0, 999), min_size=1, max_size=4),
    st.sampled_from(["=", "!=", "<", "<=", ">", ">="]),
)
def test_driver_comparison_matches_zero_padded_tuples(host, wanted, op):
    width = max(len(host), len(wanted))
    h, w = tuple(host) + (0,) * (width - len(host)), tuple(wanted) + (0,) * (width - len(wanted))
    expected = {"=": h == w, "!=": h != w, "<": h < w, "<=": h <= w, ">": h > w, ">=": h >= w}[op]
    facts = GpuFacts(cuda=None, driver=".".join(map(str, host)))
    r = reqs(f"driver{op}{'.'.join(map(str, wanted))}")
    if expected:
        r.check(facts)
    else:
        with pytest.raises(RequirementError):
            r.check(facts)
