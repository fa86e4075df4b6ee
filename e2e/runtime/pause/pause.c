/*
 * The pod sandbox's process for the e2e runtime (migdra.dev/e2e/pause): it holds the pod's
 * namespaces, so it only waits. As pid 1 of the pod's pid namespace it reaps every orphan that
 * is reparented to it, and it exits (status 0) on SIGINT or SIGTERM, which the kernel would
 * otherwise ignore for a pid 1 without handlers. Built static by ../images.sh.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
  (void)sig;
  _exit(0);
}

static void reap(int sig) {
  int saved = errno;
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

int main(int argc, char **argv) {
  struct sigaction sa;
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("migdra-e2e pause");
    return 0;
  }
  if (getpid() != 1) {
    fputs("pause: warning: not pid 1, orphans are not reparented here\n", stderr);
  }
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = stop;
  if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0) {
    perror("pause: sigaction");
    return 1;
  }
  sa.sa_handler = reap;
  sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGCHLD, &sa, NULL) != 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) {
    pause();
  }
}
