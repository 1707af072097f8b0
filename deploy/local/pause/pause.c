/*
 * The pod sandbox's process (the image the kubelet's containerd starts first in every pod, which
 * holds the pod's namespaces): it sleeps until SIGTERM or SIGINT and reaps any child that ends,
 * as PID 1 of a shared PID namespace must. Built statically, it is the only file of its image.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("kvxfer-pause 1");
    return 0;
  }
  struct sigaction stop, child;
  memset(&stop, 0, sizeof stop);
  memset(&child, 0, sizeof child);
  stop.sa_handler = on_stop;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) pause();
}
