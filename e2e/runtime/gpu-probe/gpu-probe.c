/* gpu-probe: the e2e workload image's program. Prints, as one JSON object on stdout, what
 * the container it runs in got:
 *
 *   "devices":   every /dev/nvidia* and /dev/nvidia-caps entry: path, type ("c", "b",
 *                "dir", "link", "file", "other"), and major/minor of device nodes;
 *   "env":       every NVIDIA_*, CUDA_* and MIGDRA_* variable;
 *   "libraries": for libnvidia-ml.so.1 and libcuda.so.1, the path `ldconfig -p` lists (the
 *                dynamic linker's cache, which nvidia-cdi-hook's update-ldcache rewrites),
 *                what dlopen() does with the soname: the path it loaded, or its error (the
 *                fake driver's libraries are not ELF objects, so the error names the file the
 *                linker found), and "resolved": that file with its symlinks resolved (the
 *                soname links nvidia-cdi-hook's create-symlinks made), else null;
 *   "ld_so_conf": the directories the files in /etc/ld.so.conf.d list;
 *   "mounts":    every entry of /proc/self/mountinfo: mount point ("path"), the mounted
 *                directory or file within its filesystem ("root"), filesystem type, source,
 *                and whether the mount is read-only;
 *   "nvidia_smi": the exit status and output of `nvidia-smi -L` when nvidia-smi is on PATH,
 *                else null.
 *
 * Then, by its arguments:
 *   (none)        exits 0;
 *   sleep         waits for SIGTERM/SIGINT and exits 0, so a test can read its report from
 *                 a running pod;
 *   sleep N       waits N seconds (or for SIGTERM/SIGINT) and exits 0;
 *   COMMAND ARGS  execs COMMAND, so a pod can run a shell script after the report. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <time.h>
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static void json_string(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    switch (*p) {
    case '"': fputs("\\\"", stdout); break;
    case '\\': fputs("\\\\", stdout); break;
    case '\n': fputs("\\n", stdout); break;
    case '\t': fputs("\\t", stdout); break;
    case '\r': fputs("\\r", stdout); break;
    default:
      if (*p < 0x20)
        printf("\\u%04x", *p);
      else
        putchar(*p);
    }
  }
  putchar('"');
}

static int compare_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Prints the entries of dir whose names start with prefix, sorted, as device objects. */
static int print_devices(const char *dir, const char *prefix, int first) {
  DIR *d = opendir(dir);
  if (!d)
    return first;
  char **names = NULL;
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, prefix, strlen(prefix)) != 0 || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    char **grown = realloc(names, (n + 1) * sizeof *names);
    if (!grown)
      break;
    names = grown;
    names[n++] = strdup(e->d_name);
  }
  closedir(d);
  qsort(names, n, sizeof *names, compare_names);
  for (size_t i = 0; i < n; i++) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    free(names[i]);
    if (lstat(path, &st) != 0)
      continue;
    const char *type = S_ISCHR(st.st_mode) ? "c" : S_ISBLK(st.st_mode) ? "b" : S_ISDIR(st.st_mode) ? "dir"
                     : S_ISLNK(st.st_mode) ? "link" : S_ISREG(st.st_mode) ? "file" : "other";
    printf("%s\n    {\"path\": ", first ? "" : ",");
    json_string(path);
    printf(", \"type\": \"%s\"", type);
    if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))
      printf(", \"major\": %u, \"minor\": %u", major(st.st_rdev), minor(st.st_rdev));
    putchar('}');
    first = 0;
  }
  free(names);
  return first;
}

/* Runs argv, returns its exit status (-1 if it could not run) and its stdout+stderr in *out. */
static int capture(char *const argv[], char **out) {
  int pipefd[2];
  *out = NULL;
  if (pipe(pipefd) != 0)
    return -1;
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    dup2(pipefd[1], 1);
    dup2(pipefd[1], 2);
    close(pipefd[0]);
    close(pipefd[1]);
    execvp(argv[0], argv);
    _exit(127);
  }
  close(pipefd[1]);
  size_t len = 0, cap = 4096;
  char *buf = malloc(cap);
  ssize_t r;
  while (buf && (r = read(pipefd[0], buf + len, cap - len - 1)) > 0) {
    len += (size_t)r;
    if (cap - len < 2) {
      char *grown = realloc(buf, cap *= 2);
      if (!grown) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = grown;
    }
  }
  close(pipefd[0]);
  if (buf)
    buf[len] = '\0';
  *out = buf;
  int status;
  if (waitpid(pid, &status, 0) < 0)
    return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The path `ldconfig -p` lists for soname (the first x86-64 entry), or NULL. */
static char *ldconfig_path(const char *ldconfig_output, const char *soname) {
  if (!ldconfig_output)
    return NULL;
  const char *line = ldconfig_output;
  size_t n = strlen(soname);
  while (*line) {
    const char *end = strchrnul(line, '\n');
    const char *p = line;
    while (*p == ' ' || *p == '\t')
      p++;
    if (!strncmp(p, soname, n) && p[n] == ' ') {
      const char *arrow = strstr(p, " => ");
      if (arrow && arrow < end && memmem(p, (size_t)(arrow - p), "x86-64", 6))
        return strndup(arrow + 4, (size_t)(end - arrow - 4));
    }
    line = *end ? end + 1 : end;
  }
  return NULL;
}

static void print_library(const char *ldconfig_output, const char *soname, int last) {
  printf("    ");
  json_string(soname);
  printf(": {\"ldconfig\": ");
  char *cached = ldconfig_path(ldconfig_output, soname);
  if (cached) {
    json_string(cached);
    free(cached);
  } else {
    fputs("null", stdout);
  }
  void *handle = dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
  char found[PATH_MAX] = "";
  if (handle) {
    struct link_map *map = NULL;
    printf(", \"dlopen\": ");
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map) {
      json_string(map->l_name);
      snprintf(found, sizeof found, "%s", map->l_name);
    } else {
      json_string("?");
    }
    printf(", \"error\": null");
  } else {
    const char *err = dlerror();
    printf(", \"dlopen\": null, \"error\": ");
    json_string(err ? err : "unknown");
    /* glibc's "<path>: <reason>" when it found a file it could not load. */
    const char *colon = err ? strstr(err, ": ") : NULL;
    if (err && err[0] == '/' && colon && (size_t)(colon - err) < sizeof found)
      snprintf(found, sizeof found, "%.*s", (int)(colon - err), err);
  }
  char resolved[PATH_MAX];
  printf(", \"resolved\": ");
  if (found[0] && realpath(found, resolved))
    json_string(resolved);
  else
    fputs("null", stdout);
  putchar('}');
  puts(last ? "" : ",");
}

/* Prints the directories listed by the files in /etc/ld.so.conf.d, sorted by file name. */
static void print_ld_so_conf(void) {
  struct dirent **files = NULL;
  int n = scandir("/etc/ld.so.conf.d", &files, NULL, alphasort);
  int first = 1;
  for (int i = 0; i < n; i++) {
    char path[4096];
    snprintf(path, sizeof path, "/etc/ld.so.conf.d/%s", files[i]->d_name);
    free(files[i]);
    FILE *f = fopen(path, "r");
    if (!f)
      continue;
    char line[4096];
    while (fgets(line, sizeof line, f)) {
      line[strcspn(line, "\n")] = '\0';
      if (line[0] != '/')
        continue;
      printf("%s", first ? "" : ", ");
      json_string(line);
      first = 0;
    }
    fclose(f);
  }
  free(files);
}

/* Prints /proc/self/mountinfo's entries as mount objects. A line reads:
 * ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER-OPTIONS */
static void print_mounts(void) {
  FILE *f = fopen("/proc/self/mountinfo", "r");
  if (!f)
    return;
  char *line = NULL;
  size_t cap = 0;
  int first = 1;
  while (getline(&line, &cap, f) > 0) {
    char *fields[64];
    int n = 0;
    for (char *save = NULL, *t = strtok_r(line, " \n", &save); t && n < 64; t = strtok_r(NULL, " \n", &save))
      fields[n++] = t;
    int dash = 6;
    while (dash < n && strcmp(fields[dash], "-"))
      dash++;
    if (dash + 2 >= n)
      continue;
    char *options = fields[5];
    int ro = !strcmp(options, "ro") || !strncmp(options, "ro,", 3);
    printf("%s\n    {\"path\": ", first ? "" : ",");
    json_string(fields[4]);
    printf(", \"root\": ");
    json_string(fields[3]);
    printf(", \"fstype\": ");
    json_string(fields[dash + 1]);
    printf(", \"source\": ");
    json_string(fields[dash + 2]);
    printf(", \"ro\": %s}", ro ? "true" : "false");
    first = 0;
  }
  free(line);
  fclose(f);
}

/* Waits for SIGTERM/SIGINT, at most seconds (forever if negative). */
static void wait_for_signal(long seconds) {
  sigset_t set;
  int sig;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigprocmask(SIG_BLOCK, &set, NULL);
  if (seconds < 0) {
    sigwait(&set, &sig);
    return;
  }
  struct timespec deadline, now;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += seconds;
  for (;;) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    struct timespec left = {deadline.tv_sec - now.tv_sec, deadline.tv_nsec - now.tv_nsec};
    if (left.tv_nsec < 0) {
      left.tv_sec--;
      left.tv_nsec += 1000000000L;
    }
    if (left.tv_sec < 0)
      return;
    if (sigtimedwait(&set, NULL, &left) >= 0 || errno != EINTR)
      return;
  }
}

int main(int argc, char **argv) {
  long sleep_seconds = -1;
  int sleep_after = argc > 1 && !strcmp(argv[1], "sleep");
  if (sleep_after && argc > 2) {
    char *end;
    sleep_seconds = strtol(argv[2], &end, 10);
    if (argc > 3 || *end || end == argv[2] || sleep_seconds < 0) {
      fprintf(stderr, "usage: gpu-probe [sleep [SECONDS] | COMMAND [ARG...]]\n");
      return 2;
    }
  }
  printf("{\n  \"devices\": [");
  int first = print_devices("/dev", "nvidia", 1);
  print_devices("/dev/nvidia-caps", "", first);
  printf("\n  ],\n  \"env\": {");
  first = 1;
  for (char **e = environ; *e; e++) {
    const char *eq = strchr(*e, '=');
    if (!eq || !(!strncmp(*e, "NVIDIA_", 7) || !strncmp(*e, "CUDA_", 5) || !strncmp(*e, "MIGDRA_", 7)))
      continue;
    char *name = strndup(*e, (size_t)(eq - *e));
    printf("%s\n    ", first ? "" : ",");
    json_string(name ? name : "");
    printf(": ");
    json_string(eq + 1);
    free(name);
    first = 0;
  }
  printf("\n  },\n  \"libraries\": {\n");
  char *ldconfig_output = NULL;
  char *const ldconfig[] = {"ldconfig", "-p", NULL};
  if (capture(ldconfig, &ldconfig_output) != 0) {
    free(ldconfig_output);
    ldconfig_output = NULL;
  }
  print_library(ldconfig_output, "libnvidia-ml.so.1", 0);
  print_library(ldconfig_output, "libcuda.so.1", 1);
  free(ldconfig_output);
  printf("  },\n  \"ld_so_conf\": [");
  print_ld_so_conf();
  printf("],\n  \"mounts\": [");
  print_mounts();
  printf("\n  ],\n  \"nvidia_smi\": ");
  char *smi_output = NULL;
  char *const smi[] = {"nvidia-smi", "-L", NULL};
  int status = capture(smi, &smi_output);
  if (status == 127 || status < 0) {
    fputs("null", stdout);
  } else {
    printf("{\"exit_code\": %d, \"output\": ", status);
    json_string(smi_output ? smi_output : "");
    putchar('}');
  }
  free(smi_output);
  printf("\n}\n");
  fflush(stdout);
  if (sleep_after) {
    wait_for_signal(sleep_seconds);
  } else if (argc > 1) {
    execvp(argv[1], argv + 1);
    fprintf(stderr, "gpu-probe: cannot run %s: %s\n", argv[1], strerror(errno));
    return 127;
  }
  return 0;
}
