/* Stands in for nvidia-cuda-mps-control with the real one's interface, as driver 550's behaves
 * (seen running without a GPU): `-d` starts the control daemon in the background, listening on
 * $CUDA_MPS_PIPE_DIRECTORY/control (default /tmp/nvidia-mps) and logging to
 * $CUDA_MPS_LOG_DIRECTORY/control.log (default /var/log/nvidia-mps) with "Cmd:<command>" lines;
 * without arguments it sends its stdin's commands to that daemon and prints the answers, or says
 * "Cannot find MPS control daemon process" and exits 1. Defaults set through
 * set_default_active_thread_percentage and set_default_device_pinned_mem_limit are answered back
 * by the get_ commands; quit stops the daemon. Each command is also appended to
 * SIM_ROOT/mps-control.log as "<pipe directory> <command>", the simulated host's record of what
 * every daemon was told. While it runs, <pipe directory>/nvidia-cuda-mps-control.pid holds its pid,
 * as the real one's does. The daemon also makes cuda.shm.sim in the /dev/shm it sees, as the real
 * server makes its cuda.shm.* files, so tests can see which /dev/shm that is. It opens those names
 * as the real one does (strace of driver 550's: control_lock, then the pid file, each O_CREAT
 * without O_NOFOLLOW, as root): a link put at one of them is written through, which is why the
 * device plugin gives each daemon a directory and a /dev/shm no pod has had (node/mps.py). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "sim_host.h"

#define MAX_DEVICES 64

static char pipe_dir[256], log_dir[256];
static double threads = 100.0;
static char limits[MAX_DEVICES][32];

static void record(const char *line)
{
    char path[512];
    FILE *f;
    snprintf(path, sizeof path, "%s/control.log", log_dir);
    if ((f = fopen(path, "a")) != NULL) {
        fprintf(f, "[simulated Control %5d] %s\n", (int)getpid(), line);
        fclose(f);
    }
    snprintf(path, sizeof path, "%s/mps-control.log", SIM_ROOT);
    if ((f = fopen(path, "a")) != NULL) {
        fprintf(f, "%s %s\n", pipe_dir, line);
        fclose(f);
    }
}

static int control_address(struct sockaddr_un *addr)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    return snprintf(addr->sun_path, sizeof addr->sun_path, "%s/control", pipe_dir) < (int)sizeof addr->sun_path;
}

/* One command's answer into out; returns 1 when the daemon is to quit. */
static int command(char *cmd, FILE *out)
{
    char logged[600];
    unsigned dev;
    char value[32];
    double percent;
    snprintf(logged, sizeof logged, "Cmd:%s", cmd);
    record(logged);
    if (strcmp(cmd, "quit") == 0)
        return 1;
    if (sscanf(cmd, "set_default_active_thread_percentage %lf", &percent) == 1 && percent > 0 && percent <= 100) {
        threads = percent;
        fprintf(out, "%.1f\n", threads);
    } else if (strcmp(cmd, "get_default_active_thread_percentage") == 0) {
        fprintf(out, "%.1f\n", threads);
    } else if (sscanf(cmd, "set_default_device_pinned_mem_limit %u %31s", &dev, value) == 2 && dev < MAX_DEVICES) {
        snprintf(limits[dev], sizeof limits[dev], "%s", value);
    } else if (sscanf(cmd, "get_default_device_pinned_mem_limit %u", &dev) == 1 && dev < MAX_DEVICES) {
        fprintf(out, "%s\n", limits[dev][0] ? limits[dev] : "0");
    } else if (strcmp(cmd, "get_server_list") == 0) {
    } else {
        fprintf(out, "Unknown command \"%s\"\n", cmd);
    }
    return 0;
}

static int daemon_main(void)
{
    struct sockaddr_un addr;
    int listener, ready[2];
    char line[512];
    pid_t pid;

    if (access(pipe_dir, W_OK) != 0) {
        fprintf(stderr, "Cannot access CUDA_MPS_PIPE_DIRECTORY=%s\n", pipe_dir);
        return 1;
    }
    if (!control_address(&addr) || pipe(ready) != 0)
        return 1;
    if ((listener = socket(AF_UNIX, SOCK_STREAM, 0)) < 0)
        return 1;
    if (connect(listener, (struct sockaddr *)&addr, sizeof addr) == 0) {
        fprintf(stderr, "An instance of this daemon is already running\n");
        return 1;
    }
    unlink(addr.sun_path); /* one a daemon that died left behind: nothing answers on it */
    close(listener);
    if ((listener = socket(AF_UNIX, SOCK_STREAM, 0)) < 0)
        return 1;
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0) {
        fprintf(stderr, errno == EADDRINUSE ? "An instance of this daemon is already running\n" : "bind: %s\n",
                strerror(errno));
        return 1;
    }
    chmod(addr.sun_path, 0666);
    listen(listener, 16);
    if ((pid = fork()) < 0)
        return 1;
    if (pid > 0) { /* the parent returns once the daemon is answering, as the real one does */
        char c;
        close(ready[1]);
        return read(ready[0], &c, 1) == 1 ? 0 : 1;
    }
    setsid();
    signal(SIGPIPE, SIG_IGN);
    int null = open("/dev/null", O_RDWR); /* a daemon keeps none of its starter's files open */
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        if (null > 2)
            close(null);
    }
    close(ready[0]);
    char lock_path[300];
    snprintf(lock_path, sizeof lock_path, "%s/control_lock", pipe_dir);
    int lock = open(lock_path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666); /* held while it runs */
    (void)lock;
    FILE *shm = fopen("/dev/shm/cuda.shm.sim", "w");
    if (shm)
        fclose(shm);
    char pid_path[300];
    snprintf(pid_path, sizeof pid_path, "%s/nvidia-cuda-mps-control.pid", pipe_dir);
    FILE *pid_file = fopen(pid_path, "w"); /* the real daemon's pid file, there while it runs */
    if (pid_file) {
        fprintf(pid_file, "%d\n", (int)getpid());
        fclose(pid_file);
    }
    snprintf(line, sizeof line, "Starting control daemon using socket %s", addr.sun_path);
    record(line);
    if (write(ready[1], "1", 1) != 1)
        return 1;
    close(ready[1]);
    for (;;) {
        int conn = accept(listener, NULL, NULL);
        if (conn < 0)
            continue;
        FILE *in = fdopen(conn, "r"), *out = fdopen(dup(conn), "w");
        int quit = 0;
        if (!in || !out)
            return 1;
        while (!quit && fgets(line, sizeof line, in)) {
            line[strcspn(line, "\r\n")] = 0;
            if (line[0])
                quit = command(line, out);
            fflush(out);
        }
        if (quit) { /* gone before the client sees the end of its answer: its `quit` returns then */
            record("Exit with status 0");
            unlink(addr.sun_path);
            unlink(pid_path);
            unlink("/dev/shm/cuda.shm.sim");
        }
        fclose(out);
        fclose(in);
        if (quit)
            return 0;
    }
}

static int client_main(void)
{
    struct sockaddr_un addr;
    char buf[4096];
    ssize_t n;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || !control_address(&addr) || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        printf(" Cannot find MPS control daemon process\n");
        return 1;
    }
    while ((n = read(0, buf, sizeof buf)) > 0)
        if (write(fd, buf, (size_t)n) != n)
            return 1;
    shutdown(fd, SHUT_WR);
    while ((n = read(fd, buf, sizeof buf)) > 0)
        fwrite(buf, 1, (size_t)n, stdout);
    return 0;
}

int main(int argc, char **argv)
{
    const char *p = getenv("CUDA_MPS_PIPE_DIRECTORY"), *l = getenv("CUDA_MPS_LOG_DIRECTORY");
    snprintf(pipe_dir, sizeof pipe_dir, "%s", p && *p ? p : "/tmp/nvidia-mps");
    snprintf(log_dir, sizeof log_dir, "%s", l && *l ? l : "/var/log/nvidia-mps");
    if (argc > 1 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        printf("CUDA MPS Control for Linux/Unix (simulated, driver %s).\n", SIM_DRIVER_VERSION);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "-d") == 0)
        return daemon_main();
    if (argc > 1) {
        fprintf(stderr, "%s: unknown option %s\n", argv[0], argv[1]);
        return 1;
    }
    return client_main();
}
