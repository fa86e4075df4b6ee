/* gpu-probe: the e2e workload image's program. Prints, as one JSON object on stdout, what
 * the container it runs in got:
 *
 *   "devices":   every /dev/nvidia* and /dev/nvidia-caps entry: path, type ("c", "b",
 *                "dir", "link", "file", "other"), and major/minor of device nodes;
 *   "env":       NVIDIA_VISIBLE_DEVICES and every MIGDRA_* variable;
 *   "libraries": for libnvidia-ml.so.1 and libcuda.so.1, the path `ldconfig -p` lists (the
 *                dynamic linker's cache, which nvidia-cdi-hook's update-ldcache rewrites),
 *                and what dlopen() does with the soname: the path it loaded, or its error
 *                (the fake driver's libraries are not ELF objects, so the error names the
 *                file the linker found);
 *   "nvidia_smi": the exit status and output of `nvidia-smi -L` when nvidia-smi is on PATH,
 *                else null.
 *
 * Exits 0 once it has printed the object. With an argument "sleep", it then waits for
 * SIGTERM/SIGINT, so a test can read its log from a running pod. */
#define _GNU_SOURCE
#include <dirent.h>
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
  if (handle) {
    struct link_map *map = NULL;
    printf(", \"dlopen\": ");
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map)
      json_string(map->l_name);
    else
      json_string("?");
    printf(", \"error\": null}");
  } else {
    const char *err = dlerror();
    printf(", \"dlopen\": null, \"error\": ");
    json_string(err ? err : "unknown");
    putchar('}');
  }
  puts(last ? "" : ",");
}

static void wait_for_signal(void) {
  sigset_t set;
  int sig;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigprocmask(SIG_BLOCK, &set, NULL);
  sigwait(&set, &sig);
}

int main(int argc, char **argv) {
  int sleep_after = argc > 1 && !strcmp(argv[1], "sleep");
  if (argc > 1 && !sleep_after) {
    fprintf(stderr, "usage: gpu-probe [sleep]\n");
    return 2;
  }
  printf("{\n  \"devices\": [");
  int first = print_devices("/dev", "nvidia", 1);
  print_devices("/dev/nvidia-caps", "", first);
  printf("\n  ],\n  \"env\": {");
  first = 1;
  for (char **e = environ; *e; e++) {
    const char *eq = strchr(*e, '=');
    if (!eq || !(!strncmp(*e, "NVIDIA_VISIBLE_DEVICES=", 23) || !strncmp(*e, "MIGDRA_", 7)))
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
  printf("  },\n  \"nvidia_smi\": ");
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
  if (sleep_after)
    wait_for_signal();
  return 0;
}
