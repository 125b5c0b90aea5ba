/*
 * ceilingfs: the ceiling of a FUSE daemon serving files from memory, for scripts/bench.
 *
 * A minimal read-only file system on libfuse 3's low-level API: it loads a
 * directory tree (names, sizes and bytes) into memory at start, then answers
 * LOOKUP, GETATTR, READ and READDIR from memory and nothing else. It
 * negotiates what unshardfs's kernel engine negotiates, so the two differ in
 * the work per request and not in the protocol:
 *   - no-open: OPEN answered ENOSYS, so the kernel sends no more OPEN nor
 *     RELEASE and keeps each file's pages across opens (keep_cache);
 *   - requests of --max-pages pages (max_write; libfuse derives max_pages
 *     from it), the kernel's max_readahead, max_background 64, congestion
 *     threshold 48, async reads, parallel directory operations;
 *   - READ replies spliced (FUSE_CAP_SPLICE_WRITE, fuse_reply_data with a
 *     fuse_bufvec naming a file descriptor): the bytes are held in a memfd
 *     (memory, as a file), libfuse splices them into a pipe as page
 *     references and the pipe into /dev/fuse: one copy, into the request's
 *     pages, as unshardfs splices from the shard's page cache. (A bufvec of
 *     plain memory would be written into the pipe first: two copies.)
 *     --write answers from plain memory with writev instead (one copy too).
 *   - entry and attribute timeouts of --timeout seconds, negative entries
 *     cached as long.
 *
 * Usage: ceilingfs [--mt] [--write] [--spin-us N] [--max-pages N] [--timeout S] SOURCE MOUNTPOINT
 *   --mt: fuse_session_loop_mt (libfuse's worker threads), else one thread.
 *   --spin-us N: burn N microseconds of CPU in every LOOKUP and READ before answering (what a
 *     daemon's own work per request costs a row, measured without that daemon).
 * Runs in the foreground until unmounted.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct node {
	char *name;
	fuse_ino_t parent;
	int is_dir;
	off_t size;
	off_t at; /* where its bytes start in the memfd */
	struct timespec mtime;
	fuse_ino_t *children;
	size_t nchildren, cap;
};

static struct node *nodes; /* nodes[ino - 1]; the root is inode 1 */
static size_t nnodes, nodes_cap;
static double timeout = 3600.0;
static unsigned max_pages = 254;
static int write_replies; /* --write: writev from memory, not spliced from the memfd */
static int memfd = -1; /* every file's bytes, one after another */
static off_t memfd_size;
static char *memory; /* the memfd mapped */
static long spin_ns; /* --spin-us */

static void spin(void)
{
	if (!spin_ns)
		return;
	struct timespec t0, t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
	do
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < spin_ns);
}

static fuse_ino_t add_node(const char *name, fuse_ino_t parent, int is_dir)
{
	if (nnodes == nodes_cap) {
		nodes_cap = nodes_cap ? 2 * nodes_cap : 1024;
		nodes = realloc(nodes, nodes_cap * sizeof *nodes);
		if (!nodes) { perror("realloc"); exit(1); }
	}
	struct node *n = &nodes[nnodes++];
	memset(n, 0, sizeof *n);
	n->name = strdup(name);
	n->parent = parent;
	n->is_dir = is_dir;
	fuse_ino_t ino = nnodes;
	if (parent) {
		struct node *p = &nodes[parent - 1];
		if (p->nchildren == p->cap) {
			p->cap = p->cap ? 2 * p->cap : 16;
			p->children = realloc(p->children, p->cap * sizeof *p->children);
			if (!p->children) { perror("realloc"); exit(1); }
		}
		p->children[p->nchildren++] = ino;
	}
	return ino;
}

static void load(const char *path, fuse_ino_t dir)
{
	DIR *d = opendir(path);
	if (!d) { perror(path); exit(1); }
	struct dirent *e;
	char child[4096];
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(child, sizeof child, "%s/%s", path, e->d_name);
		struct stat st;
		if (stat(child, &st)) { perror(child); exit(1); }
		if (S_ISDIR(st.st_mode)) {
			fuse_ino_t ino = add_node(e->d_name, dir, 1);
			nodes[ino - 1].mtime = st.st_mtim;
			load(child, ino);
		} else if (S_ISREG(st.st_mode)) {
			fuse_ino_t ino = add_node(e->d_name, dir, 0);
			struct node *n = &nodes[ino - 1];
			n->size = st.st_size;
			n->mtime = st.st_mtim;
			n->at = memfd_size;
			int fd = open(child, O_RDONLY);
			if (fd < 0) { perror(child); exit(1); }
			char chunk[1 << 16];
			for (off_t got = 0; got < st.st_size;) {
				ssize_t k = pread(fd, chunk, sizeof chunk, got);
				if (k <= 0) { perror(child); exit(1); }
				if (pwrite(memfd, chunk, k, memfd_size) != k) { perror("memfd"); exit(1); }
				got += k;
				memfd_size += k;
			}
			close(fd);
		}
	}
	closedir(d);
}

static void fill_attr(fuse_ino_t ino, struct stat *st)
{
	struct node *n = &nodes[ino - 1];
	memset(st, 0, sizeof *st);
	st->st_ino = ino;
	st->st_mode = n->is_dir ? (S_IFDIR | 0555) : (S_IFREG | 0444);
	st->st_nlink = n->is_dir ? 2 : 1;
	st->st_uid = getuid();
	st->st_gid = getgid();
	st->st_size = n->size;
	st->st_blocks = (n->size + 511) / 512;
	st->st_blksize = 1 << 17;
	st->st_atim = st->st_mtim = st->st_ctim = n->mtime;
}

static int valid(fuse_ino_t ino)
{
	return ino >= 1 && ino <= nnodes;
}

static void ceiling_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	if (conn->capable & FUSE_CAP_SPLICE_WRITE)
		conn->want |= FUSE_CAP_SPLICE_WRITE;
	conn->want &= ~(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_MOVE);
	if (conn->capable & FUSE_CAP_NO_OPEN_SUPPORT)
		conn->want |= FUSE_CAP_NO_OPEN_SUPPORT;
	if (conn->capable & FUSE_CAP_PARALLEL_DIROPS)
		conn->want |= FUSE_CAP_PARALLEL_DIROPS;
	conn->max_write = max_pages * 4096; /* libfuse asks for max_pages from it */
	conn->max_background = 64;
	conn->congestion_threshold = 48;
}

static void ceiling_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	struct fuse_entry_param e;
	spin();
	memset(&e, 0, sizeof e);
	e.attr_timeout = timeout;
	e.entry_timeout = timeout;
	if (!valid(parent) || !nodes[parent - 1].is_dir) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	struct node *p = &nodes[parent - 1];
	for (size_t i = 0; i < p->nchildren; i++) {
		fuse_ino_t ino = p->children[i];
		if (!strcmp(nodes[ino - 1].name, name)) {
			e.ino = ino;
			fill_attr(ino, &e.attr);
			fuse_reply_entry(req, &e);
			return;
		}
	}
	fuse_reply_entry(req, &e); /* ino 0: the kernel caches the miss for entry_timeout */
}

static void ceiling_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)fi;
	if (!valid(ino)) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	struct stat st;
	fill_attr(ino, &st);
	fuse_reply_attr(req, &st, timeout);
}

static void ceiling_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	(void)fi;
	fuse_reply_err(req, ENOSYS); /* no-open: the kernel stops sending OPEN and RELEASE */
}

static void ceiling_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	(void)fi;
	spin();
	if (!valid(ino) || nodes[ino - 1].is_dir) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	struct node *n = &nodes[ino - 1];
	if (off >= n->size) {
		fuse_reply_buf(req, NULL, 0);
		return;
	}
	if ((off_t)size > n->size - off)
		size = n->size - off;
	struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
	if (write_replies) {
		buf.buf[0].mem = memory + n->at + off;
		fuse_reply_data(req, &buf, FUSE_BUF_NO_SPLICE);
	} else {
		buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
		buf.buf[0].fd = memfd;
		buf.buf[0].pos = n->at + off;
		fuse_reply_data(req, &buf, 0);
	}
}

static void ceiling_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	(void)fi;
	if (!valid(ino) || !nodes[ino - 1].is_dir) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	struct node *d = &nodes[ino - 1];
	char *buf = malloc(size);
	size_t used = 0;
	for (size_t i = off; i < d->nchildren; i++) {
		struct stat st;
		fill_attr(d->children[i], &st);
		size_t want = fuse_add_direntry(req, buf + used, size - used, nodes[d->children[i] - 1].name, &st, i + 1);
		if (want > size - used)
			break;
		used += want;
	}
	fuse_reply_buf(req, buf, used);
	free(buf);
}

static const struct fuse_lowlevel_ops ops = {
	.init = ceiling_init,
	.lookup = ceiling_lookup,
	.getattr = ceiling_getattr,
	.open = ceiling_open,
	.read = ceiling_read,
	.readdir = ceiling_readdir,
};

int main(int argc, char **argv)
{
	int mt = 0, i = 1;
	for (; i < argc && !strncmp(argv[i], "--", 2); i++) {
		if (!strcmp(argv[i], "--mt"))
			mt = 1;
		else if (!strcmp(argv[i], "--write"))
			write_replies = 1;
		else if (!strcmp(argv[i], "--spin-us") && i + 1 < argc)
			spin_ns = atol(argv[++i]) * 1000L;
		else if (!strcmp(argv[i], "--max-pages") && i + 1 < argc)
			max_pages = (unsigned)atoi(argv[++i]);
		else if (!strcmp(argv[i], "--timeout") && i + 1 < argc)
			timeout = atof(argv[++i]);
		else {
			fprintf(stderr, "ceilingfs: unknown option %s\n", argv[i]);
			return 2;
		}
	}
	if (argc - i != 2 || max_pages < 1 || max_pages > 256) {
		fprintf(stderr, "usage: ceilingfs [--mt] [--write] [--spin-us N] [--max-pages 1..256] [--timeout S] SOURCE MOUNTPOINT\n");
		return 2;
	}
	struct stat st;
	if (stat(argv[i], &st) || !S_ISDIR(st.st_mode)) {
		fprintf(stderr, "ceilingfs: %s is not a directory\n", argv[i]);
		return 1;
	}
	memfd = memfd_create("ceilingfs", MFD_CLOEXEC);
	if (memfd < 0) { perror("memfd_create"); return 1; }
	fuse_ino_t root = add_node("", 0, 1);
	nodes[root - 1].mtime = st.st_mtim;
	load(argv[i], root);
	memory = mmap(NULL, memfd_size ? memfd_size : 1, PROT_READ, MAP_SHARED, memfd, 0);
	if (memory == MAP_FAILED) { perror("mmap"); return 1; }

	char *fargv[] = {argv[0], "-o", "ro,fsname=ceilingfs,subtype=ceilingfs", NULL};
	struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
	struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
	if (!se)
		return 1;
	int ret = 1;
	if (fuse_set_signal_handlers(se) == 0) {
		if (fuse_session_mount(se, argv[i + 1]) == 0) {
			if (mt) {
				struct fuse_loop_config config = {.clone_fd = 0, .max_idle_threads = 10};
				ret = fuse_session_loop_mt(se, &config);
			} else {
				ret = fuse_session_loop(se);
			}
			fuse_session_unmount(se);
		}
		fuse_remove_signal_handlers(se);
	}
	fuse_session_destroy(se);
	return ret ? 1 : 0;
}
