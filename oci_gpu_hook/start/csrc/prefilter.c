/*
 * oci-gpu-hook's pre-filter: the program a runtime runs in front of the Python hook.
 *
 * Most containers ask for no GPU, and for them the whole hook is "read the state and the
 * bundle's config.json, see nothing that asks, exit 0". Starting an interpreter for that costs
 * more than the rest of the container's start (docs/performance.md, round 3). This program does
 * that much itself and execs the Python hook (PYTHON_HOOK, with the same arguments and the state
 * it read on a fresh stdin) for everything else.
 *
 * It exits 0 on its own only when it is sure the Python hook would: the state and config.json are
 * read and checked as start/state.py and start/spec.py check them, and the rule is
 * start/prestart.py's may_ask_for_gpus, whose values (prefilter_rule.h) toolkit/prefilter.py
 * writes from start/prefilter_rule.py. Whatever it cannot decide exactly (input Python would reject, JSON it
 * does not parse, a value outside ASCII, a mount destination near the device-list directory) goes
 * to the Python hook, which then says what is wrong in its own words and with its own exit status.
 * It opens nothing but config.json, runs nothing but PYTHON_HOOK, and allocates only from a
 * bounded arena.
 *
 * Built with START_SERVER (install's, the RPM's), it first offers what it would hand to Python to
 * the start server listening there (start/server.py): a warm process that already paid for the
 * interpreter and the imports, which most of a GPU start cost (docs/performance.md). The offer is
 * one message: the arguments, and as descriptors the state (a memfd) and this program's stdout and
 * stderr, so that the server's worker reads the same state and says what it says to the runtime
 * directly. The replies are "taken" (answered "go") and then the exit status, or "not taken", or
 * nothing within START_SERVER_TAKE_MS: then the start is Python's, as where no server listens (none
 * installed, stopped, hung, not root), and the worker, which acts only on "go", does nothing. Only root
 * offers (the server also wants all of its own capabilities and its mount namespace), only to a
 * server that is root, and only when no OCI_GPU_HOOK_ variable is set here (the worker has the
 * server's environment, not this one). Once "go" is said there is no going back to Python: the
 * worker may have changed the container, and a second hook on top of it is not the same start.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "prefilter_rule.h"

#ifndef PYTHON_HOOK
#error "PYTHON_HOOK: the Python hook to run for everything this program does not decide"
#endif

/* What tells the program apart from others at its path (toolkit/prefilter.py, is_prefilter). */
__attribute__((used)) static const char MARKER[] = "oci-gpu-hook pre-filter: runs " PYTHON_HOOK;
#ifdef START_SERVER
/* And the socket it offers starts to (toolkit/prefilter.py, offers_to): the copy offer_to_server
 * makes is built from immediate stores, so the path is nowhere else in the program as one string. */
__attribute__((used)) static const char OFFERS_MARKER[] = "oci-gpu-hook pre-filter: offers starts to " START_SERVER;
/* And the version line it offers with, the code's identity in it (toolkit/prefilter.py, offers_as:
 * doctor compares it with the installed code's and the server's). */
__attribute__((used)) static const char VERSION_MARKER[] = "oci-gpu-hook pre-filter: offers as " START_SERVER_VERSION;
#endif

#define MAX_DEPTH 64 /* deeper documents go to Python, whose limit is far above this */
#define INTERNAL_EXIT 70

enum kind { J_NULL, J_FALSE, J_TRUE, J_INT, J_NUMBER, J_STRING, J_ARRAY, J_OBJECT };

struct value {
    enum kind kind;
    const char *text; /* J_STRING: decoded UTF-8 (may hold NUL); a member's key in key */
    size_t length;
    const char *key;
    size_t key_length;
    long long integer; /* J_INT that fits; big marks one that does not */
    int big;
    size_t count; /* J_ARRAY, J_OBJECT */
    struct value *first, *next;
};

/* Every region carved from the one mapping, and every block the arena hands out, starts at a
 * multiple of this, so that anything C may store there (a struct value above all) is aligned as it
 * requires. The inputs' rooms are one byte over a power of two: laid end to end unrounded, they put
 * the arena, and so every value, 2 bytes past a multiple of 8 (issue 36). */
#define ALIGNMENT _Alignof(max_align_t)
_Static_assert((ALIGNMENT & (ALIGNMENT - 1)) == 0, "an alignment is a power of two");
_Static_assert(_Alignof(struct value) <= ALIGNMENT, "a value fits the arena's alignment");

/* n rounded up to ALIGNMENT; n is bounded by the mapping's size, far from overflowing. */
static size_t aligned(size_t n) { return (n + ALIGNMENT - 1) & ~(size_t)(ALIGNMENT - 1); }

struct arena {
    char *base; /* aligned: the mapping's start plus aligned rooms */
    size_t used, size;
};

static void *take(struct arena *a, size_t n) {
    if (n > a->size - a->used) /* before rounding: n stays small, so aligned(n) cannot wrap */
        return NULL;
    n = aligned(n);
    if (n > a->size - a->used)
        return NULL;
    void *p = a->base + a->used;
    a->used += n;
    return p;
}

struct parser {
    const unsigned char *p, *end;
    struct arena *arena;
    int depth;
};

/* Python decodes the whole input as strict UTF-8 before parsing: one bad byte anywhere is an error. */
static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned min, cp;
        if (c >= 0xc2 && c <= 0xdf) {
            len = 2, min = 0x80, cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            len = 3, min = 0x800, cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            len = 4, min = 0x10000, cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i < len)
            return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += len;
    }
    return 1;
}

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void skip_ws(struct parser *ps) {
    while (ps->p < ps->end && is_ws(*ps->p))
        ps->p++;
}

static int hex4(const unsigned char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return 0;
        v = v << 4 | d;
    }
    *out = v;
    return 1;
}

/* A string after its opening quote, decoded into the arena; 0 for anything Python's strict
 * scanner would refuse, and for lone surrogates (which it would keep: Python decides those). */
static int parse_string(struct parser *ps, const char **text, size_t *length) {
    const unsigned char *start = ps->p;
    size_t raw = 0, left = (size_t)(ps->end - start);
    while (raw < left && start[raw] != '"')
        raw += start[raw] == '\\' ? 2 : 1;
    if (raw >= left)
        return 0;
    char *out = take(ps->arena, raw + 1); /* decoding never lengthens */
    if (!out)
        return 0;
    size_t n = 0;
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char c = *ps->p++;
        if (c < 0x20)
            return 0;
        if (c != '\\') {
            out[n++] = (char)c;
            continue;
        }
        if (ps->p >= ps->end)
            return 0;
        c = *ps->p++;
        switch (c) {
        case '"': out[n++] = '"'; break;
        case '\\': out[n++] = '\\'; break;
        case '/': out[n++] = '/'; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'n': out[n++] = '\n'; break;
        case 'r': out[n++] = '\r'; break;
        case 't': out[n++] = '\t'; break;
        case 'u': {
            unsigned cp, low;
            if (ps->end - ps->p < 4 || !hex4(ps->p, &cp))
                return 0;
            ps->p += 4;
            if (cp >= 0xdc00 && cp <= 0xdfff)
                return 0;
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (ps->end - ps->p < 6 || ps->p[0] != '\\' || ps->p[1] != 'u' || !hex4(ps->p + 2, &low) ||
                    low < 0xdc00 || low > 0xdfff)
                    return 0;
                ps->p += 6;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
            }
            /* \uXXXX is 6 bytes in, at most 4 out; a pair is 12 in, 4 out */
            if (cp < 0x80) {
                out[n++] = (char)cp;
            } else if (cp < 0x800) {
                out[n++] = (char)(0xc0 | cp >> 6);
                out[n++] = (char)(0x80 | (cp & 0x3f));
            } else if (cp < 0x10000) {
                out[n++] = (char)(0xe0 | cp >> 12);
                out[n++] = (char)(0x80 | (cp >> 6 & 0x3f));
                out[n++] = (char)(0x80 | (cp & 0x3f));
            } else {
                out[n++] = (char)(0xf0 | cp >> 18);
                out[n++] = (char)(0x80 | (cp >> 12 & 0x3f));
                out[n++] = (char)(0x80 | (cp >> 6 & 0x3f));
                out[n++] = (char)(0x80 | (cp & 0x3f));
            }
            break;
        }
        default:
            return 0;
        }
    }
    if (ps->p >= ps->end)
        return 0;
    ps->p++; /* the closing quote */
    *text = out;
    *length = n;
    return 1;
}

static int digit(const unsigned char *p, const unsigned char *end) { return p < end && *p >= '0' && *p <= '9'; }

/* Past one or more digits, or NULL where there is none. */
static const unsigned char *digits_after(const unsigned char *p, const unsigned char *end) {
    if (!digit(p, end))
        return NULL;
    while (digit(p, end))
        p++;
    return p;
}

/* Python's number grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][-+]?[0-9]+)?; NaN and Infinity,
 * which Python also takes, are left to it. */
static int parse_number(struct parser *ps, struct value *v) {
    const unsigned char *p = ps->p;
    int negative = 0;
    if (p < ps->end && *p == '-')
        negative = 1, p++;
    if (!digit(p, ps->end))
        return 0;
    const unsigned char *digits = p;
    if (*p == '0')
        p++;
    else
        while (digit(p, ps->end))
            p++;
    size_t ndigits = (size_t)(p - digits);
    int integral = 1;
    if (p < ps->end && *p == '.') {
        if (!(p = digits_after(p + 1, ps->end)))
            return 0;
        integral = 0;
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < ps->end && (*p == '+' || *p == '-'))
            p++;
        if (!(p = digits_after(p, ps->end)))
            return 0;
        integral = 0;
    }
    v->kind = integral ? J_INT : J_NUMBER;
    /* Python refuses to convert an integer of more digits than its limit (CVE-2020-10735): a
     * document with one is an error there, so it is Python's to report. */
    if (integral && ndigits > RULE_MAX_INT_DIGITS)
        return 0;
    if (integral) {
        if (ndigits > 18) {
            v->big = 1;
        } else {
            long long x = 0;
            for (size_t i = 0; i < ndigits; i++)
                x = x * 10 + (digits[i] - '0');
            v->integer = negative ? -x : x;
        }
    }
    ps->p = p;
    return 1;
}

static int literal(struct parser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0)
        return 0;
    ps->p += n;
    return 1;
}

static struct value *parse_value(struct parser *ps);

static struct value *parse_container(struct parser *ps, struct value *v, int object) {
    struct value **tail = &v->first;
    unsigned char close = object ? '}' : ']';
    if (++ps->depth > MAX_DEPTH)
        return NULL;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        ps->depth--;
        return v;
    }
    for (;;) {
        const char *key = NULL;
        size_t key_length = 0;
        if (object) {
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != '"')
                return NULL;
            ps->p++;
            if (!parse_string(ps, &key, &key_length))
                return NULL;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':')
                return NULL;
            ps->p++;
        }
        struct value *item = parse_value(ps);
        if (!item)
            return NULL;
        item->key = key;
        item->key_length = key_length;
        *tail = item;
        tail = &item->next;
        v->count++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            ps->depth--;
            return v;
        }
        return NULL;
    }
}

static struct value *parse_value(struct parser *ps) {
    skip_ws(ps);
    if (ps->p >= ps->end)
        return NULL;
    struct value *v = take(ps->arena, sizeof *v);
    if (!v)
        return NULL;
    memset(v, 0, sizeof *v);
    unsigned char c = *ps->p;
    if (c == '{' || c == '[') {
        ps->p++;
        v->kind = c == '{' ? J_OBJECT : J_ARRAY;
        return parse_container(ps, v, c == '{');
    }
    if (c == '"') {
        ps->p++;
        v->kind = J_STRING;
        return parse_string(ps, &v->text, &v->length) ? v : NULL;
    }
    if (c == 'n')
        return literal(ps, "null") ? (v->kind = J_NULL, v) : NULL;
    if (c == 't')
        return literal(ps, "true") ? (v->kind = J_TRUE, v) : NULL;
    if (c == 'f')
        return literal(ps, "false") ? (v->kind = J_FALSE, v) : NULL;
    return parse_number(ps, v) ? v : NULL;
}

/* The whole document, as jsonio.loads takes it (whitespace around one value), or NULL. */
static struct value *parse_document(const unsigned char *data, size_t n, struct arena *arena) {
    if (!valid_utf8(data, n))
        return NULL;
    struct parser ps = {data, data + n, arena, 0};
    struct value *v = parse_value(&ps);
    skip_ws(&ps);
    return v && ps.p == ps.end ? v : NULL;
}

static int is(const char *text, size_t length, const char *word) {
    return length == strlen(word) && memcmp(text, word, length) == 0;
}

/* A member of an object; the last of duplicate keys, as a Python dict keeps it. */
static struct value *member(const struct value *object, const char *name) {
    struct value *found = NULL;
    if (object && object->kind == J_OBJECT)
        for (struct value *m = object->first; m; m = m->next)
            if (is(m->key, m->key_length, name))
                found = m;
    return found;
}

static int has_nul(const struct value *s) { return memchr(s->text, '\0', s->length) != NULL; }

static int ascii_digits(const char *s, size_t n) {
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* state.supported_oci_version: 1.x.y, an optional -suffix. */
static int supported_version(const struct value *v) {
    const char *s = v->text, *end = memchr(s, '-', v->length);
    size_t n = end ? (size_t)(end - s) : v->length;
    const char *dot1 = memchr(s, '.', n);
    if (!dot1)
        return 0;
    const char *dot2 = memchr(dot1 + 1, '.', n - (size_t)(dot1 + 1 - s));
    if (!dot2 || memchr(dot2 + 1, '.', n - (size_t)(dot2 + 1 - s)))
        return 0;
    return is(s, (size_t)(dot1 - s), "1") && ascii_digits(dot1 + 1, (size_t)(dot2 - dot1 - 1)) &&
           ascii_digits(dot2 + 1, n - (size_t)(dot2 + 1 - s));
}

static size_t characters(const struct value *s) {
    size_t n = 0;
    for (size_t i = 0; i < s->length; i++)
        n += ((unsigned char)s->text[i] & 0xc0) != 0x80;
    return n;
}

static int falsy(const struct value *v) {
    return v->kind == J_NULL || v->kind == J_FALSE || (v->kind == J_STRING && v->length == 0) ||
           ((v->kind == J_ARRAY || v->kind == J_OBJECT) && v->count == 0);
}

/* The bundle, when the state is one state.parse accepts; NULL otherwise (Python says why). */
static const struct value *checked_bundle(const struct value *doc) {
    if (!doc || doc->kind != J_OBJECT)
        return NULL;
    const struct value *version = member(doc, "ociVersion"), *id = member(doc, "id");
    const struct value *status = member(doc, "status"), *bundle = member(doc, "bundle");
    const struct value *pid = member(doc, "pid"), *annotations = member(doc, "annotations");
    if (!version || version->kind != J_STRING || !supported_version(version))
        return NULL;
    if (!id || id->kind != J_STRING || id->length == 0 || has_nul(id) || characters(id) > 1024)
        return NULL;
    if (!status || status->kind != J_STRING)
        return NULL;
    if (!bundle || bundle->kind != J_STRING || bundle->length == 0 || bundle->text[0] != '/' || has_nul(bundle))
        return NULL;
    if (pid && pid->kind != J_NULL && (pid->kind != J_INT || pid->big || pid->integer <= 0 || pid->integer >= 1 << 22))
        return NULL;
    if (annotations && !falsy(annotations)) {
        if (annotations->kind != J_OBJECT)
            return NULL;
        for (const struct value *m = annotations->first; m; m = m->next)
            if (m->kind != J_STRING)
                return NULL;
    }
    return bundle;
}

static int python_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f); }

static int starts_with(const char *text, size_t length, const char *prefix) {
    size_t n = strlen(prefix);
    return length >= n && memcmp(text, prefix, n) == 0;
}

static int contains(const char *text, size_t length, const char *part) {
    return memmem(text, length, part, strlen(part)) != NULL;
}

/* NVIDIA_VISIBLE_DEVICES asks unless it is blank or names the no-device value, as
 * may_ask_for_gpus reads it; outside ASCII, Python's idea of white space decides. */
static int visible_asks(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return 1;
    int blank = 1;
    for (size_t i = 0; i < n; i++)
        blank &= python_space((unsigned char)s[i]);
    if (blank)
        return 0;
    size_t start = 0;
    while (start <= n) {
        const char *comma = memchr(s + start, ',', n - start);
        size_t stop = comma ? (size_t)(comma - s) : n, a = start, b = stop;
        while (a < b && python_space((unsigned char)s[a]))
            a++;
        while (b > a && python_space((unsigned char)s[b - 1]))
            b--;
        if (is(s + a, b - a, RULE_NO_DEVICES))
            return 0;
        start = stop + 1;
    }
    return 1;
}

/* 1: may ask for GPUs (or undecided), 0: spec.parse accepts it and it cannot ask. */
static int may_ask(const struct value *doc) {
    if (!doc || doc->kind != J_OBJECT)
        return 1;
    const struct value *root = member(doc, "root");
    const struct value *path = root && root->kind == J_OBJECT ? member(root, "path") : NULL;
    if (!path || path->kind != J_STRING || path->length == 0 || has_nul(path))
        return 1;
    const struct value *process = member(doc, "process");
    const struct value *env = process && process->kind == J_OBJECT ? member(process, "env") : NULL;
    const struct value *visible = NULL;
    if (env && env->kind == J_ARRAY)
        for (const struct value *e = env->first; e; e = e->next) {
            if (e->kind != J_STRING)
                continue;
            const char *eq = memchr(e->text, '=', e->length);
            if (!eq || eq == e->text)
                continue;
            size_t key = (size_t)(eq - e->text);
            if (is(e->text, key, RULE_LEGACY_VARIABLE) || starts_with(e->text, key, RULE_CDI_DEVICE_PREFIX))
                return 1;
            if (is(e->text, key, RULE_VISIBLE_DEVICES))
                visible = e;
        }
    if (visible) {
        size_t key = strlen(RULE_VISIBLE_DEVICES) + 1;
        if (visible_asks(visible->text + key, visible->length - key))
            return 1;
    }
    const struct value *annotations = member(doc, "annotations");
    if (annotations && annotations->kind == J_OBJECT)
        for (const struct value *a = annotations->first; a; a = a->next)
            if (starts_with(a->key, a->key_length, RULE_ANNOTATION_PREFIX))
                return 1;
    /* Any destination with the list directory's name in it: a superset of the normalised rule. */
    const struct value *mounts = member(doc, "mounts");
    if (mounts && mounts->kind == J_ARRAY)
        for (const struct value *m = mounts->first; m; m = m->next) {
            const struct value *destination = member(m, "destination");
            if (destination && destination->kind == J_STRING &&
                contains(destination->text, destination->length, RULE_VOLUME_MOUNT_NAME))
                return 1;
        }
    return 0;
}

/* Up to limit + 1 bytes of fd (one more than allowed tells a file too large); -1 on error. */
static ssize_t read_up_to(int fd, unsigned char *buffer, size_t limit) {
    size_t n = 0;
    while (n < limit + 1) {
        ssize_t got = read(fd, buffer + n, limit + 1 - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return -1;
        if (got == 0)
            break;
        n += (size_t)got;
    }
    return (ssize_t)n;
}

/* The bundle's config.json, opened as files.read_bounded opens it; -1 when Python should say why. */
static ssize_t read_config(const struct value *bundle, unsigned char *buffer, size_t limit) {
    char path[4096];
    const char *slash = bundle->text[bundle->length - 1] == '/' ? "" : "/";
    int n = snprintf(path, sizeof path, "%.*s%sconfig.json", (int)bundle->length, bundle->text, slash);
    if (n < 0 || (size_t)n >= sizeof path)
        return -1;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return -1;
    struct stat st;
    ssize_t got = -1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
        got = read_up_to(fd, buffer, limit);
    close(fd);
    return got;
}

#ifdef START_SERVER
#define NO_SERVER (-1)

/* Whole milliseconds from now to deadline (CLOCK_MONOTONIC), rounded down, at least 0: a wait of
 * that many ends by the deadline. Counted in nanoseconds first: where the deadline's nanoseconds
 * are below now's (a whole second between), C's division would round their negative part up. */
static int ms_until(const struct timespec *deadline) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (long long)(deadline->tv_sec - now.tv_sec) * 1000000000 + (deadline->tv_nsec - now.tv_nsec);
    return ns <= 0 ? 0 : (int)(ns / 1000000);
}

/* One reply of up to 2 bytes by deadline (NULL: none, wait as long as it takes); 0 when nothing
 * came in time or the server closed. */
static ssize_t reply_by(int s, unsigned char reply[2], const struct timespec *deadline) {
    for (;;) {
        struct pollfd p = {.fd = s, .events = POLLIN};
        int ready = poll(&p, 1, deadline ? ms_until(deadline) : -1);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0)
            return 0;
        ssize_t got = recv(s, reply, 2, MSG_DONTWAIT);
        if (got < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        return got < 0 ? 0 : got;
    }
}

/* The start server's verdict on this start, or NO_SERVER when it did not take the start (so that
 * Python must). statefd: the state, read from its start.
 *
 * Nothing here waits on the server past START_SERVER_TAKE_MS from the connect: the connect and the
 * offer never block (a full queue, a stopped server: Python's), and "taken" must come by then. A
 * "taken" heard in time is answered "go", and only "go" lets the worker touch anything: so when the
 * wait ends first, nothing was done, and the start is Python's. A late "taken" meets a closed
 * connection, and its worker exits. After "go" the worker's own deadline bounds the wait for the
 * verdict (start/server.py). */
static int offer_to_server(char **argv, int statefd) {
    if (geteuid() != 0) /* rootless: the server is root's, and acts as root */
        return NO_SERVER;
    extern char **environ;
    for (char **e = environ; *e; e++) /* what the hook reads of its environment a worker lacks */
        if (strncmp(*e, START_SERVER_ENV_PREFIX, sizeof START_SERVER_ENV_PREFIX - 1) == 0)
            return NO_SERVER;
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    _Static_assert(sizeof START_SERVER <= sizeof address.sun_path, "the start server's path fits a socket address");
    memcpy(address.sun_path, START_SERVER, sizeof START_SERVER);
    char payload[sizeof START_SERVER_VERSION + 8192];
    size_t used = sizeof START_SERVER_VERSION;
    memcpy(payload, START_SERVER_VERSION, sizeof START_SERVER_VERSION);
    static const char *const options[] = START_SERVER_OPTIONS; /* the launcher's, before argv's */
    for (int from = 0; from < 2; from++) {
        const char *const *args = from == 0 ? options : (const char *const *)argv + 1;
        for (int i = 0; args[i]; i++) {
            size_t length = strlen(args[i]) + 1;
            if (length > sizeof payload - used)
                return NO_SERVER;
            memcpy(payload + used, args[i], length);
            used += length;
        }
    }
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += START_SERVER_TAKE_MS / 1000;
    deadline.tv_nsec += (long)(START_SERVER_TAKE_MS % 1000) * 1000000;
    if (deadline.tv_nsec >= 1000000000) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000;
    }
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
        return NO_SERVER;
    struct ucred peer;
    socklen_t peer_length = sizeof peer;
    /* Non-blocking, a Unix socket's connect either completes or fails at once (EAGAIN: the
     * server's queue is full). */
    if (connect(s, (struct sockaddr *)&address, sizeof address) != 0 ||
        getsockopt(s, SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) != 0 || peer_length != sizeof peer ||
        peer.uid != 0) { /* a socket at that path that is not root's is not the server */
        close(s);
        return NO_SERVER;
    }
    ssize_t sent;
    do
        sent = send(s, payload, used, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (sent < 0 && errno == EINTR);
    if (sent != (ssize_t)used) { /* not delivered (a packet is all or nothing): nothing was started */
        close(s);
        return NO_SERVER;
    }
    /* The replies: 'p' (passed: not taken, nothing done: the server refused the offer, say one of
     * other code after an upgrade, or it had no worker), or 'a' (taken: a worker holds the offer
     * and waits for 'g'), then 'v' and the exit status. Nothing by the deadline (a server stopped,
     * hung or busy) is nothing done too: Python's. */
    unsigned char reply[2];
    ssize_t got = reply_by(s, reply, &deadline);
    if (got == 1 && reply[0] == 'a') {
        /* 'g' carries the descriptors: the state, and this program's stdout and stderr. Never
         * before: the runtime waits for the end of those pipes, and copies of them queued in a
         * stopped server's socket would hold it there. */
        int fds[3] = {statefd, STDOUT_FILENO, STDERR_FILENO};
        union {
            struct cmsghdr header;
            char room[CMSG_SPACE(sizeof fds)];
        } control;
        memset(&control, 0, sizeof control);
        char go = 'g';
        struct iovec iov = {&go, 1};
        struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.room,
                                 .msg_controllen = sizeof control.room};
        struct cmsghdr *c = CMSG_FIRSTHDR(&message);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof fds);
        memcpy(CMSG_DATA(c), fds, sizeof fds);
        ssize_t said;
        do
            said = sendmsg(s, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (said < 0 && errno == EINTR);
        if (said == 1) { /* from here the worker may change the container: no going back to Python */
            got = reply_by(s, reply, NULL);
            close(s);
            if (got == 2 && reply[0] == 'v')
                return reply[1];
            fprintf(stderr, "oci-gpu-hook: the start server's worker ended without a verdict (killed?); "
                            "the server's log says why (journalctl -u oci-gpu-hook-start.service)\n");
            return INTERNAL_EXIT;
        }
    }
    close(s); /* 'p', nothing in time, a late or lost worker: nothing was done */
    return lseek(statefd, 0, SEEK_SET) == 0 ? NO_SERVER : INTERNAL_EXIT;
}
#endif

/* Run the Python hook with the same arguments and the state already read on a fresh stdin. */
static int run_python(char **argv, const unsigned char *state, size_t n, int have_read) {
    if (have_read) {
        int fd = memfd_create("oci-gpu-hook-state", MFD_CLOEXEC);
        size_t written = 0;
        while (fd >= 0 && written < n) {
            ssize_t w = write(fd, state + written, n - written);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                if (w == 0)
                    errno = EIO;
                close(fd);
                fd = -1;
                break;
            }
            written += (size_t)w;
        }
        if (fd < 0 || lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) != 0) {
            fprintf(stderr, "oci-gpu-hook: internal error: cannot hand the state to %s: %s\n", PYTHON_HOOK,
                    strerror(errno));
            return INTERNAL_EXIT;
        }
#ifdef START_SERVER
        int verdict = offer_to_server(argv, fd);
        if (verdict != NO_SERVER)
            return verdict;
#endif
        close(fd);
    }
    argv[0] = (char *)PYTHON_HOOK;
    execv(PYTHON_HOOK, argv);
    fprintf(stderr, "oci-gpu-hook: internal error: cannot run %s: %s\n", PYTHON_HOOK, strerror(errno));
    return INTERNAL_EXIT;
}

/* hook.run's test for a runtime's command: [--config FILE | --config=FILE] and one of
 * RUNTIME_COMMANDS. Behind a launcher that puts its own --config first, only the command. */
static int runtime_command(int argc, char **argv) {
    static const char *const commands[] = RULE_RUNTIME_COMMANDS;
    int i = 1;
    if (!RULE_LAUNCHER_OPTIONS && argc > 2 && strcmp(argv[1], "--config") == 0)
        i = 3;
    else if (!RULE_LAUNCHER_OPTIONS && argc > 1 && strncmp(argv[1], "--config=", 9) == 0)
        i = 2;
    if (argc != i + 1)
        return 0;
    for (size_t k = 0; commands[k]; k++)
        if (strcmp(argv[i], commands[k]) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 1) { /* no argv[0] to replace: the array would end where the environment begins */
        fprintf(stderr, "oci-gpu-hook: internal error: started without arguments\n");
        return INTERNAL_EXIT;
    }
    if (!runtime_command(argc, argv))
        return run_python(argv, NULL, 0, 0);
    /* Everything below lives in one mapping of a fixed size, touched only as far as it is used:
     * the two inputs, and the values parsed from them. A document whose values do not fit (far
     * more nodes per byte than any runtime writes) goes to Python whole. */
    /* Each room rounded up, so each region starts aligned (mmap's start is page-aligned). */
    size_t state_room = aligned(RULE_MAX_STATE_BYTES + 1), config_room = aligned(RULE_MAX_CONFIG_BYTES + 1);
    size_t values = aligned(2 * (state_room + config_room) + (1 << 20));
    size_t size = state_room + config_room + values;
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED)
        return run_python(argv, NULL, 0, 0);
    unsigned char *state = map, *config = state + state_room;
    struct arena arena = {(char *)config + config_room, 0, values};
    ssize_t n = read_up_to(0, state, RULE_MAX_STATE_BYTES);
    if (n < 0) /* nothing to hand on: Python meets the same stdin */
        return run_python(argv, NULL, 0, 0);
    if ((size_t)n > RULE_MAX_STATE_BYTES)
        return run_python(argv, state, (size_t)n, 1);
    const struct value *bundle = checked_bundle(parse_document(state, (size_t)n, &arena));
    if (!bundle)
        return run_python(argv, state, (size_t)n, 1);
    ssize_t c = read_config(bundle, config, RULE_MAX_CONFIG_BYTES);
    if (c < 0 || (size_t)c > RULE_MAX_CONFIG_BYTES || may_ask(parse_document(config, (size_t)c, &arena)))
        return run_python(argv, state, (size_t)n, 1);
    return 0;
}
