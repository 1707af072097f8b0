// The fault harness's delay line (issue 52) for kernels without netem: packets an iptables rule
// sends to NFQUEUE queue <n> are held <delay> ms, plus or minus up to <jitter> ms uniformly at
// random, then accepted. By default packets leave in the order they came (a packet is never due
// before the one ahead of it, as on a real path, where jitter is queueing); with "reorder",
// jitter larger than the gap between packets reorders them, as netem's does. Packets due at the
// same microsecond leave in arrival order. Verdicts are given when each packet is due, not in
// arrival order (libnetfilter_queue allows that); only packet metadata is copied to user space.
//
//   nfq-delay <queue> <delay_ms> <jitter_ms> [order|reorder] [seed]
//
// Prints "ready" once bound; runs until SIGTERM or SIGINT, then accepts what it still holds.
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// Packets held at once at most; past it a packet is accepted at once (never dropped by us).
#define MAX_HELD 65536

typedef struct {
  uint32_t id;
  uint64_t due_us;
  uint64_t seq;  // arrival order: the tie-break between packets due at the same microsecond
} Held;

static Held held[MAX_HELD];
static size_t n_held = 0;
static double delay_us = 0, jitter_us = 0;
static int reorder = 0;
static uint64_t next_seq = 0, last_due_us = 0;
static volatile sig_atomic_t stop = 0;
static uint64_t rng = 88172645463325252ull;

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

// xorshift64: a uniform double in [0, 1).
static double uniform(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}

static int before(const Held* a, const Held* b) {
  return a->due_us < b->due_us || (a->due_us == b->due_us && a->seq < b->seq);
}

// A binary heap on (due_us, seq): the next packet due is held[0].
static void push(uint32_t id, uint64_t due) {
  size_t i = n_held++;
  held[i].id = id;
  held[i].due_us = due;
  held[i].seq = next_seq++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!before(&held[i], &held[p])) break;
    Held t = held[p];
    held[p] = held[i];
    held[i] = t;
    i = p;
  }
}

static Held pop(void) {
  Held top = held[0];
  held[0] = held[--n_held];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < n_held && before(&held[l], &held[m])) m = l;
    if (r < n_held && before(&held[r], &held[m])) m = r;
    if (m == i) break;
    Held t = held[m];
    held[m] = held[i];
    held[i] = t;
    i = m;
  }
  return top;
}

static int on_packet(struct nfq_q_handle* qh, struct nfgenmsg* msg, struct nfq_data* nfa,
                     void* data) {
  (void)msg;
  (void)data;
  struct nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (ph == NULL) return 0;
  uint32_t id = ntohl(ph->packet_id);
  double d = delay_us + (jitter_us > 0 ? (uniform() * 2 - 1) * jitter_us : 0);
  if (d < 0) d = 0;
  if (n_held >= MAX_HELD || d == 0) return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  uint64_t due = now_us() + (uint64_t)d;
  if (!reorder && due < last_due_us) due = last_due_us;
  last_due_us = due;
  push(id, due);
  return 0;
}

static void on_signal(int sig) {
  (void)sig;
  stop = 1;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: nfq-delay <queue> <delay_ms> <jitter_ms> [order|reorder] [seed]\n");
    return 2;
  }
  int queue = atoi(argv[1]);
  delay_us = atof(argv[2]) * 1000.0;
  jitter_us = atof(argv[3]) * 1000.0;
  if (argc > 4) {
    if (strcmp(argv[4], "reorder") == 0) {
      reorder = 1;
    } else if (strcmp(argv[4], "order") != 0) {
      fprintf(stderr, "nfq-delay: mode '%s' is neither 'order' nor 'reorder'\n", argv[4]);
      return 2;
    }
  }
  if (argc > 5) rng = strtoull(argv[5], NULL, 10) | 1u;
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);

  struct nfq_handle* h = nfq_open();
  if (h == NULL) {
    perror("nfq_open");
    return 1;
  }
  struct nfq_q_handle* qh = nfq_create_queue(h, (uint16_t)queue, &on_packet, NULL);
  if (qh == NULL) {
    perror("nfq_create_queue");
    nfq_close(h);
    return 1;
  }
  // Metadata only: the payload stays in the kernel.
  if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) {
    perror("nfq_set_mode");
    return 1;
  }
  nfq_set_queue_maxlen(qh, MAX_HELD);
  int fd = nfq_fd(h);
  // A large receive buffer: a burst of packets must not overflow the netlink socket.
  nfnl_rcvbufsiz(nfq_nfnlh(h), 64u << 20);
  printf("ready\n");
  fflush(stdout);

  char buf[4096] __attribute__((aligned));
  while (!stop) {
    uint64_t now = now_us();
    while (n_held > 0 && held[0].due_us <= now) {
      Held p = pop();
      nfq_set_verdict(qh, p.id, NF_ACCEPT, 0, NULL);
    }
    int timeout_ms = 100;
    if (n_held > 0) {
      uint64_t wait = held[0].due_us > now ? held[0].due_us - now : 0;
      timeout_ms = (int)((wait + 999) / 1000);
    }
    struct pollfd pfd = {fd, POLLIN, 0};
    int r = poll(&pfd, 1, timeout_ms);
    if (r < 0 && errno != EINTR) break;
    if (r > 0) {
      for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0) break;
        nfq_handle_packet(h, buf, (int)n);
      }
    }
  }
  while (n_held > 0) nfq_set_verdict(qh, pop().id, NF_ACCEPT, 0, NULL);
  nfq_destroy_queue(qh);
  nfq_close(h);
  return 0;
}
