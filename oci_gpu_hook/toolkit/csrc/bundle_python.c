/* A bundle's bin/python3 (toolkit/bundle.py): runs the bundle's own interpreter through the
 * bundle's own dynamic loader, with the bundle's own libraries, wherever the bundle was copied.
 *
 * Why a program: a bundle is copied from the node image onto hosts whose C library and Python
 * are not the image's (RHCOS's, RHEL's). The interpreter's PT_INTERP names the host's loader, so
 * it cannot be run directly; its loader, run as a program with --library-path, loads it with the
 * bundle's libraries alone (--inhibit-cache keeps the host's ld.so.cache out), and --argv0 gives
 * Python this program's path, from which it finds the bundle's standard library (lib/pythonX.Y).
 * Static, so that it needs nothing of the host's itself, and small enough to read in one look.
 *
 * The bundle's directory comes from /proc/self/exe (links resolved), never from argv[0] or the
 * environment: whoever runs it cannot point it at another loader. The variables glibc ignores
 * for a setuid program are dropped (its unsecure list: every LD_*, GLIBC_TUNABLES, GCONV_PATH,
 * LOCPATH, NLSPATH, ...), so that nothing from the caller's environment is preloaded, audited,
 * searched or loaded as a gconv module or locale: the process maps the bundle's files and what
 * the program itself opens. (The loader still reads the host's /etc/ld.so.preload, root's.)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef LOADER_NAME
#error "build with -DLOADER_NAME=\"ld-linux-x86-64.so.2\" (the loader's file name in the bundle's lib/)"
#endif

extern char **environ;

/* glibc's UNSECURE_ENVVARS (sysdeps/generic/unsecvars.h), less the LD_ ones (all dropped), and
 * its tunables. */
static const char *const unsecure[] = {
    "GCONV_PATH=", "GETCONF_DIR=", "GLIBC_TUNABLES=", "HOSTALIASES=", "LOCALDOMAIN=", "LOCPATH=",
    "MALLOC_ARENA_MAX=", "MALLOC_ARENA_TEST=", "MALLOC_MMAP_MAX_=", "MALLOC_MMAP_THRESHOLD_=",
    "MALLOC_PERTURB_=", "MALLOC_TOP_PAD_=", "MALLOC_TRACE=", "MALLOC_TRIM_THRESHOLD_=", "NIS_PATH=",
    "NLSPATH=", "RESOLV_HOST_CONF=", "RES_OPTIONS=", "TMPDIR=", "TZDIR=",
};

static int dropped(const char *variable)
{
    if (strncmp(variable, "LD_", 3) == 0)
        return 1;
    for (size_t i = 0; i < sizeof unsecure / sizeof unsecure[0]; i++)
        if (strncmp(variable, unsecure[i], strlen(unsecure[i])) == 0)
            return 1;
    return 0;
}

static void fail(const char *what, int error)
{
    dprintf(2, "oci-gpu-hook bundle: %s: %s\n", what, strerror(error));
    _exit(127);
}

static void joined(char *out, const char *bundle, const char *rest)
{
    int n = snprintf(out, PATH_MAX, "%s/%s", bundle, rest);
    if (n < 0 || n >= PATH_MAX)
        fail(bundle, ENAMETOOLONG);
}

int main(int argc, char **argv)
{
    static char bundle[PATH_MAX], loader[PATH_MAX], libraries[PATH_MAX], self[PATH_MAX], program[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", bundle, sizeof bundle - 1);
    if (n <= 0 || n >= (ssize_t)sizeof bundle - 1)
        fail("/proc/self/exe", n < 0 ? errno : ENAMETOOLONG);
    bundle[n] = '\0';
    memcpy(self, bundle, (size_t)n + 1);
    for (int up = 0; up < 2; up++) { /* <bundle>/bin/python3 -> <bundle> */
        char *slash = strrchr(bundle, '/');
        if (slash == NULL || slash == bundle)
            fail(self, EINVAL);
        *slash = '\0';
    }
    joined(loader, bundle, "lib/" LOADER_NAME);
    joined(libraries, bundle, "lib");
    joined(program, bundle, "bin/python3.bin");

    char **args = calloc((size_t)argc + 8, sizeof *args);
    if (args == NULL)
        fail("memory", ENOMEM);
    int k = 0;
    args[k++] = loader;
    args[k++] = "--inhibit-cache";
    args[k++] = "--library-path";
    args[k++] = libraries;
    args[k++] = "--argv0";
    args[k++] = self;
    args[k++] = program;
    for (int i = 1; i < argc; i++)
        args[k++] = argv[i];
    args[k] = NULL;

    size_t kept = 0;
    for (char **e = environ; e != NULL && *e != NULL; e++)
        if (!dropped(*e))
            environ[kept++] = *e;
    if (environ != NULL)
        environ[kept] = NULL;
    execve(loader, args, environ);
    fail(loader, errno);
    return 127;
}
